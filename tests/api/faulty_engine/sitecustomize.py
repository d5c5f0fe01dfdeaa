"""A fault no valid request can cause, for tests that need the engine to fail one request.

Python imports `sitecustomize` at start-up from the first folder on its path that has one; a
test puts this folder first on PYTHONPATH for the server it starts (both of its processes). With
VLMSERVE_TEST_POISON_SEED set, the sampler raises for any batch holding a row with that seed, so
the engine's step fails, and again when that request is run alone."""

from __future__ import annotations

import os

_seed = os.environ.get("VLMSERVE_TEST_POISON_SEED")
if _seed is not None:
    from vlmserve.engine.sampler import Sampler

    _poison = int(_seed)
    _real = Sampler.__call__

    def _poisoned(self, logits, params, *rest):  # type: ignore[no-untyped-def]
        if any(p.seed == _poison for p in params):
            raise RuntimeError("injected sampler failure at /srv/secret/weights 0x7f3a2c")
        return _real(self, logits, params, *rest)

    Sampler.__call__ = _poisoned  # type: ignore[method-assign]
