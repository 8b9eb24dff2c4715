"""Memory service: state shared across replicas (suffix-cache feed; correction memory to come)."""
