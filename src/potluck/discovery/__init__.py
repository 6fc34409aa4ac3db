"""How a head finds its pool: mDNS announcements (mdns.py), static peers (static.py), the two
merged with the reasons for what was left out (pool.py); `potluck nodes` (nodes.py) and
`potluck doctor` (doctor.py) measure what was found (measure.py)."""
