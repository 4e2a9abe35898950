"""EvictionCache.from_request: a validated Request builds the same cache as the keyword door, parsing nothing again."""
import pytest

import vase.core.spec as spec
from vase.caches.eager import EvictionCache
from vase.core.errors import SpecError
from vase.core.spec import RequestSpec


def test_from_request_matches_keyword_door_and_does_not_revalidate(monkeypatch):
    req = RequestSpec.of("vase-attnv", 32, 8, seed=3).validate()
    door = EvictionCache(None, "vase-attnv", 32, 8, seed=3, num_layers=2)
    calls = []
    monkeypatch.setattr(spec.RequestSpec, "validate", lambda self, engine=None: calls.append(1))
    cache = EvictionCache.from_request(None, req, num_layers=2)
    assert calls == []  # nothing downstream re-parses
    assert cache.cfg == door.cfg and cache.seed == door.seed == 3
    assert cache.storage_config == door.storage_config
    assert len(cache.evicting_layers) == 2


def test_from_request_refuses_an_unvalidated_spec():
    with pytest.raises(SpecError, match="validate"):
        EvictionCache.from_request(None, RequestSpec.of("vase-attnv", 32, 8), num_layers=1)
