"""Data stage: conversations, target-regenerated replies and captured hidden-state shards."""
