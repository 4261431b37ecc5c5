"""torchvote."""
