"""Rewrites of a training step that the planners may pick instead of it: convolutions split
along their output channels (concat_split) and the step split into micro-batches (batch_split)."""
