"""The run's server rows: what ``/server_instances`` serves and ``ng_run`` prints.

Contract
--------
* :meth:`InstancesMixin.server_instances_info` gives one row per server process (name, type, impl,
  host, port, url, pid, alive; a replica also ``replica`` and ``node``); Ray replicas are asked for
  their status (bounded), so call it off an event loop.
* :func:`format_instances_table` renders rows as a plain-text table (name, type/impl, url, pid).
"""

from __future__ import annotations

from typing import Any


class InstancesMixin:
    """The run's server rows (mixed into :class:`ServerSupervisor`)."""

    def server_instances_info(self) -> list[dict[str, Any]]:
        """One row per server process (name, type, impl, host, port, url, pid, alive; a replica also
        ``replica`` and ``node``): what ``/server_instances`` serves. Replicas on Ray are asked for their
        status (bounded), so call this off an event loop."""
        rows = []
        for c in self.children:
            row = {
                "name": c.name,
                "server_type": c.instance.server_type,
                "impl": c.instance.impl,
                "host": c.host,
                "port": c.port,
                "url": c.url,
                "pid": c.process.pid if c.process else None,
                "alive": c.process is not None and c.process.poll() is None,
            }
            if c.replica is not None:
                row.update({"replica": c.replica, "node": None})
            rows.append(row)
        for inst in self.instances:
            group = self.ray_groups.get(inst.name)
            if group is None or not group.infos:
                continue
            for index, status in enumerate(group.statuses()):
                rows.append(
                    {
                        "name": inst.name,
                        "server_type": inst.server_type,
                        "impl": inst.impl,
                        "host": status.get("host"),
                        "port": status.get("port"),
                        "url": f"http://{status.get('host')}:{status.get('port')}",
                        "pid": status.get("pid"),
                        "alive": bool(status.get("alive")),
                        "replica": index,
                        "node": status.get("node"),
                        "restarts": status.get("restarts", 0),
                    }
                )
        return rows

    def num_servers(self) -> int:
        """Server processes of the run: local children and replicas placed on Ray nodes."""
        return len(self.children) + sum(len(g.infos) for g in self.ray_groups.values())


def format_instances_table(rows: list[dict[str, Any]]) -> str:
    """A plain-text table of server rows (name, type/impl, url, pid)."""
    headers = ["name", "type/impl", "url", "pid"]
    data = [
        [
            r["name"] + (f"[{r['replica']}]" if r.get("replica") is not None else ""),
            f"{r['server_type']}/{r['impl']}",
            r["url"],
            str(r["pid"]),
        ]
        for r in rows
    ]
    widths = [max(len(h), *(len(d[i]) for d in data)) if data else len(h) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(v.ljust(w) for v, w in zip(d, widths, strict=True)) for d in data]
    return "\n".join(out)
