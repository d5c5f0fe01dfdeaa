"""What the families do the same way, written once: the model protocol around a vision tower and
a decoder (model.py), the Qwen2 / Qwen3 decoder (decoder.py) and the vision towers' blocks
(vision.py). It imports no family; each family imports what it uses."""
