"""Dynamic membership in a key-value store (`disagg_cluster.cluster_uri: etcd://…`): the keys and
values every side writes and reads, as TensorRT-LLM lays them out, so a `trtllm-serve` worker and
ours register the same way and either coordinator sees both.

Upstream (NVIDIA/TensorRT-LLM, tensorrt_llm/serve/disagg_auto_scaling.py at commit
00184339b1f79ac2514a08751805b342c6b44fd8: `get_worker_key_prefix`, `get_worker_key`, `WorkerInfo`,
`DisaggClusterWorker.register_worker`; tensorrt_llm/serve/cluster_storage.py at commit
057d4a79ef0b7075dc4ce394007aa9aa9127742d: `Etcd3ClusterStorage`, a lease of `inactive_timeout_sec`
per key, refreshed every `heartbeat_interval_sec`; `ServerRole` in tensorrt_llm/llmapi/disagg_utils.py):

    key    /trtllm-disagg/<cluster_name>/workers/<worker_id>
    value  {"worker_id": str, "host": str, "port": int, "role": 0 (context) | 1 (generation)}

The key lives on an etcd lease: a worker that stops refreshing it disappears when the lease runs out,
and the coordinator learns of it from its watch. A worker serving both roles writes one key per role
(`<worker_id>/context`, `<worker_id>/generation`): upstream's value names a single role.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from urllib.parse import urlsplit

__all__ = ["ROLE_CODES", "WorkerRecord", "worker_prefix", "worker_key", "encode_worker",
           "decode_worker", "etcd_endpoints"]

# upstream ServerRole: CONTEXT = 0, GENERATION = 1 (MM_ENCODER and later ones are not served here)
ROLE_CODES = {"context": 0, "generation": 1}
_ROLE_NAMES = {v: k for k, v in ROLE_CODES.items()}


@dataclass(frozen=True, slots=True)
class WorkerRecord:
    worker_id: str
    host: str
    port: int
    role: str          # "context" | "generation"

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


def worker_prefix(cluster_name: str) -> str:
    """The prefix the coordinator watches. Upstream's prefix has no trailing slash; watching with
    one keeps cluster `a` from seeing cluster `a2`'s keys."""
    return f"/trtllm-disagg/{cluster_name}/workers/"


def worker_key(cluster_name: str, worker_id: str) -> str:
    return worker_prefix(cluster_name) + worker_id


def encode_worker(rec: WorkerRecord) -> str:
    return json.dumps({"worker_id": rec.worker_id, "host": rec.host, "port": rec.port,
                       "role": ROLE_CODES[rec.role]})


def decode_worker(raw: bytes | str) -> WorkerRecord:
    """A stored value; ValueError names what was expected and what was found."""
    try:
        d = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"expected a JSON worker record, found {raw[:80]!r} ({e})") from None
    if not isinstance(d, dict):
        raise ValueError(f"expected a JSON object, found {type(d).__name__}")
    host, port, role = d.get("host"), d.get("port"), d.get("role")
    if not isinstance(host, str) or not host:
        raise ValueError(f"expected a non-empty string 'host', found {host!r}")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"expected 'port' 1..65535, found {port!r}")
    name = _ROLE_NAMES.get(role) if isinstance(role, int) and not isinstance(role, bool) else None
    if name is None:
        raise ValueError(f"expected 'role' 0 (context) or 1 (generation), found {role!r}")
    return WorkerRecord(worker_id=str(d.get("worker_id") or ""), host=host, port=port, role=name)


def etcd_endpoints(uri: str) -> list[tuple[str, int]]:
    """`etcd://h1:2379,etcd://h2:2379` (upstream's form: comma-separated URLs) or
    `etcd://h1:2379,h2:2379` → [(host, port), …]; the port defaults to 2379."""
    if not uri.startswith("etcd://"):
        raise ValueError(f"expected 'etcd://host[:port][,…]', found {uri!r}")
    out = []
    for part in uri.split(","):
        part = part.strip()
        if not part:
            continue
        if "://" not in part:
            part = "etcd://" + part
        u = urlsplit(part)
        if u.scheme != "etcd" or not u.hostname or u.path not in ("", "/"):
            raise ValueError(f"expected 'etcd://host[:port]' in {uri!r}, found {part!r}")
        try:
            port = u.port or 2379
        except ValueError:
            raise ValueError(f"expected a port 1..65535 in {part!r}") from None
        out.append((u.hostname, port))
    if not out:
        raise ValueError(f"expected at least one etcd endpoint, found {uri!r}")
    return out
