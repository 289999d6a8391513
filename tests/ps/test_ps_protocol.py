"""Parameter-server frame meta: data only (no pickle from peers), signed under a link key, refused unread when forged."""

import pickle

import pytest
import torch

from phalanx.comm.compression.codecs import get_compressor
from phalanx.ps import protocol
from phalanx.testing import distributed

pytestmark = pytest.mark.ranks


class _Boom:
    def __reduce__(self):  # what a pickle-based decoder would run
        return (exec, ("raise SystemExit('pickle ran code from a peer')",))


def test_meta_roundtrips_as_data_and_never_unpickles():
    for name in ("none", "fp16", "int8", "topk", "powersgd"):
        tensors, meta = protocol.pack(torch.randn(300), get_compressor(name))
        single, specs, ctx = protocol.decode_meta(meta)
        assert specs == [(t.dtype, tuple(t.shape)) for t in tensors] and single == (len(tensors) == 1)
        assert meta.startswith(b"{")  # JSON, not a pickle
    with pytest.raises(protocol.PSError, match="malformed frame meta"):
        protocol.decode_meta(pickle.dumps(_Boom()))  # a pickle is just malformed bytes now
    with pytest.raises(TypeError, match="cannot encode a object"):
        protocol.encode_meta(True, [torch.ones(1)], object())


def test_bad_hmac_is_refused_before_anything_is_decoded(monkeypatch):
    key, other = b"k" * 32, b"x" * 32
    signed = protocol.encode_meta(True, [torch.ones(4)], (4, torch.float32, (4,)), key)
    assert protocol.decode_meta(signed, key) == (True, [(torch.float32, (4,))], (4, torch.float32, (4,)))
    decoded = []
    monkeypatch.setattr(protocol.json, "loads", lambda *a, **k: decoded.append(a) or {})
    tampered = bytearray(signed)
    tampered[-3] ^= 1
    for blob, k in ((signed, other), (bytes(tampered), key), (signed[32:], key), (b"", key)):
        with pytest.raises(protocol.PSAuthError, match="bad or missing HMAC"):
            protocol.decode_meta(blob, k)
    assert decoded == []  # nothing reached the decoder


def _link(keys):
    import phalanx as px

    r = px.rank()
    cache = protocol.MetaCache(key=keys[r])
    comp = get_compressor("int8")
    if r == 0:
        try:
            for _ in range(2):  # the second frame leaves the meta out (cached on both ends)
                protocol.send_frame(1, protocol.Op.PUSH, tensor=torch.arange(64.0), compressor=comp, cache=cache,
                                    timeout_s=30)
        except protocol.PSPeerError:
            return "refused"  # the receiver dropped the link after refusing the first frame
        return "sent"
    try:
        got = [protocol.recv_frame(0, comp, reply=False, timeout_s=30, what="pull", cache=cache)[1] for _ in range(2)]
    except protocol.PSAuthError as err:
        return str(err)
    return [float((g - torch.arange(64.0)).abs().max()) for g in got]


def test_signed_link_between_ranks_and_forged_sender_refused():
    same = distributed(_link, np=2, args=([b"s" * 32, b"s" * 32],))
    assert same[0] == "sent" and all(err < 0.5 for err in same[1])  # int8: quantisation error only
    forged = distributed(_link, np=2, args=([b"f" * 32, b"s" * 32],))
    assert "bad or missing HMAC" in forged[1]


def _roles_with_job_secret(wrong_key):
    """Rank 0 serves with the job secret (PHALANX_SECRET_FILE); rank 1 works with ``wrong_key`` or the secret."""
    import phalanx as px
    from phalanx.ps import ParameterServer, PSWorker
    from phalanx.runtime.jobkey import job_key

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    if px.rank() == 0:
        server = ParameterServer(model, lambda ps: torch.optim.SGD(ps, lr=0.1), servers=[0], workers=[1],
                                 timeout_s=10)
        try:
            server.serve()
            return server.cache.key == job_key(), "served"
        except protocol.PSError as err:
            return server.cache.key == job_key(), type(err).__name__
    worker = PSWorker(model, servers=[0], workers=[1], timeout_s=10, key=wrong_key)
    try:
        worker.pull()  # the server's reply meta is signed with the job secret
        worker.close()
        return worker.cache.key == job_key(), "pulled"
    except protocol.PSAuthError as err:
        return worker.cache.key == job_key(), str(err)


def test_ps_roles_sign_with_the_job_secret_and_refuse_a_bad_hmac(tmp_path):
    from phalanx.launcher.secret import new_secret, write_secret_file

    path = write_secret_file(new_secret(), str(tmp_path))
    env = {"PHALANX_SECRET_FILE": path}
    (s_keyed, served), (w_keyed, pulled) = distributed(_roles_with_job_secret, np=2, args=(None,), env=env)
    assert s_keyed and w_keyed and served == "served" and pulled == "pulled"  # both read the job secret
    (s_keyed, server_end), (w_keyed, refused) = distributed(_roles_with_job_secret, np=2, args=(b"w" * 64,),
                                                            env=env, timeout=90)
    assert s_keyed and not w_keyed
    assert "bad or missing HMAC" in refused, refused  # refused before the meta was decoded
    assert server_end != "served", server_end  # the server does not take that worker's session as done
