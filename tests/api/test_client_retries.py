"""RemoteStore retries only what is safe to send twice."""

from __future__ import annotations

import httpx
import pytest

from kvstore import errors
from kvstore.client import RemoteStore
from kvstore.records import Checkpoint


def scripted(*outcomes):
    """A transport that plays `outcomes` in order: an exception class to raise, or a
    (status, json) response. Returns (client, calls)."""
    calls = []

    def handler(request: httpx.Request):
        calls.append(request.url.path)
        outcome = outcomes[min(len(calls), len(outcomes)) - 1]
        if isinstance(outcome, type):
            raise outcome("scripted failure", request=request)
        status, body = outcome
        return httpx.Response(status, json=body)

    return httpx.Client(transport=httpx.MockTransport(handler), base_url="http://kv"), calls


OK_MISSING = (200, {"missing": []})
CKPT = Checkpoint("c", "default", b"\1" * 32, (1, 2), ())
CKPT_BODY = (201, {**{"name": "c", "namespace": "default", "format_id": "01" * 32,
                      "tokens": [1, 2], "chain_keys": [], "attachments": {}, "metadata": {}},
                   "created_ns": 1, "num_tokens": 2})


@pytest.mark.parametrize("failure", [httpx.ReadError, httpx.RemoteProtocolError, httpx.ConnectError])
def test_idempotent_requests_are_retried(failure):
    client, calls = scripted(failure, failure, OK_MISSING)
    assert RemoteStore("http://kv", client=client).missing(["ab" * 32]) == []
    assert len(calls) == 3


def test_idempotent_requests_retry_on_503_then_give_up():
    client, calls = scripted((503, {"code": "unavailable", "message": "busy"}))
    with pytest.raises(errors.StoreIOError):
        RemoteStore("http://kv", client=client, retries=2).missing(["ab" * 32])
    assert len(calls) == 3


@pytest.mark.parametrize("failure", [httpx.ReadError, httpx.RemoteProtocolError])
def test_a_checkpoint_create_that_may_have_arrived_is_not_resent(failure):
    client, calls = scripted(failure, CKPT_BODY)
    with pytest.raises(failure):
        RemoteStore("http://kv", client=client).create_checkpoint(CKPT)
    assert calls == ["/v1/checkpoints"]


def test_a_checkpoint_create_that_never_connected_is_retried():
    client, calls = scripted(httpx.ConnectError, CKPT_BODY)
    assert RemoteStore("http://kv", client=client).create_checkpoint(CKPT).name == "c"
    assert len(calls) == 2


def test_errors_are_not_retried():
    client, calls = scripted((404, {"code": "not_found", "message": "checkpoint d/c does not exist"}))
    with pytest.raises(errors.NotFound, match="does not exist"):
        RemoteStore("http://kv", client=client).get_checkpoint("d", "c")
    assert len(calls) == 1
