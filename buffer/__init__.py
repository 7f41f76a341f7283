"""streamrl package."""
