"""The family-neutral model parts: the protocol every family's model implements (base.py), shared
layers, weight-loading helpers, and build.py, which allocates a model and fills it from a
checkpoint. The families' models live in vlmserve/families/<family>/."""
