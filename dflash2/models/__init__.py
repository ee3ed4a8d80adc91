"""Built-in models: where they come from and how they are prepared."""
