"""modelfile."""
