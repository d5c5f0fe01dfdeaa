"""Model families, one folder each: config parsing, tokenizer and chat rendering, processor,
model and vision tower, tiny-checkpoint writer, and a `family.py` that describes the family to the
rest of vlmserve (vlmserve/family.py) and is listed once in vlmserve/registry.py. What several
families do the same way lives once in common/, which imports no family."""
