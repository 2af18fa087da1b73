"""The core: Transform, Chain, Modular, scope and norms, state, registry."""
