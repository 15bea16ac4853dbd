"""Third-party model architectures under standard tensor parallelism (Llama family)."""
