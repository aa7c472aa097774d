"""Example treelit plugin."""
