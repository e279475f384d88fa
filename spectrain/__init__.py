"""spectrain: RL post-training with online co-trained EAGLE-3 speculative decoding."""
__version__ = "0.1.0"
