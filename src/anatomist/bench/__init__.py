"""Real runs of a suite of recipes, each in its own process, with durable results."""
