"""What the families do the same way, written once and parameterised by what differs: the model
protocol around a vision tower and a decoder (model.py), the Qwen2 / Qwen3 decoder (decoder.py),
the vision towers' blocks (vision.py), config.json's common fields (config.py), the
tiny-checkpoint writer's pieces (tiny.py) and a family entry's (entry.py). It imports no family;
each family imports what it uses."""
