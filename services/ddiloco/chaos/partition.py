"""Cut a datacenter off in the network-namespace topology (``ddiloco.netns``) and restore it.

cut: the datacenter's end of its link to the hub goes down (``ip link set wan0 down`` in its
namespace): from then on every packet to or from it is lost, and its learner keeps training
locally. heal: the link comes back up and the routes that went away with it (the default
route through the hub) are put back, so the learner reconnects and rejoins.
"""

from __future__ import annotations

import json

from ddiloco.netns import topology as T


class NetnsPartitioner:
    def __init__(self, plan: T.Plan) -> None:
        self.links = {f"dc{d.index}": d for d in plan.datacenters}
        self._routes: dict[str, list[dict]] = {}

    def _link(self, datacenter: str) -> T.DatacenterLink:
        if datacenter not in self.links:
            raise KeyError(f"no datacenter {datacenter!r} in this topology; it has {sorted(self.links)}")
        return self.links[datacenter]

    def cut(self, datacenter: str) -> None:
        link = self._link(datacenter)
        routes = json.loads(T.ip("-j", "route", "show", netns=link.namespace).stdout or "[]")
        self._routes[datacenter] = [r for r in routes if r.get("dev") == link.dc_dev]
        T.ip("link", "set", link.dc_dev, "down", netns=link.namespace)

    def heal(self, datacenter: str) -> None:
        link = self._link(datacenter)
        T.ip("link", "set", link.dc_dev, "up", netns=link.namespace)
        for r in self._routes.pop(datacenter, []):
            if r.get("protocol") == "kernel":
                continue  # the link's own subnet route comes back with the link
            cmd = ["route", "replace", r["dst"]]
            if r.get("gateway"):
                cmd += ["via", r["gateway"]]
            T.ip(*cmd, "dev", link.dc_dev, netns=link.namespace)

    def is_cut(self, datacenter: str) -> bool:
        link = self._link(datacenter)
        info = json.loads(T.ip("-j", "link", "show", link.dc_dev, netns=link.namespace).stdout)
        return "UP" not in info[0].get("flags", [])
