"""The head's remote side: a plan run over worker nodes.

survey (ask the nodes, plan with the planner), pipeline (load each node's layers, send batches
down the chain), failover (heartbeat, re-plan, replay), replicas (whole-model copies for batch
jobs). The engine reaches it only through the Pipeline contract (engine/contract.py).
"""
