"""precast.runtime: loads engine directories and runs them."""
