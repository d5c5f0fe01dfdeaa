"""Qwen-VL-Chat's special tokens, shared by its tokenizer and its chat format so that
neither imports the other."""

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
EXTRAS = tuple(f"<|extra_{i}|>" for i in range(205))
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, *EXTRAS)
REF_START, REF_END = "<ref>", "</ref>"
BOX_START, BOX_END = "<box>", "</box>"
QUAD_START, QUAD_END = "<quad>", "</quad>"
IMAGE_START, IMAGE_END, IMAGE_PAD = "<img>", "</img>", "<imgpad>"
# The remote tokenizer's IMAGE_ST: what make_context lets through as special tokens in content.
IMAGE_ST = (REF_START, REF_END, BOX_START, BOX_END, QUAD_START, QUAD_END, IMAGE_START, IMAGE_END, IMAGE_PAD)
ALL_SPECIAL_TOKENS = SPECIAL_TOKENS + IMAGE_ST  # ids from len(ranks) on, in this order
IMG_TOKEN_SPAN = 256  # positions between <img> and </img>: an image's features, or its URL's bytes
