"""Synthetic ``ibnetdiscover`` captures of two-level fat trees, for tests and benchmarks.

The text follows the default topology format of the real captures (stanza
header, one line per connected port with the peer's description), so it goes
through the same parser. ``rails > 1`` gives every host that many HCAs, rail
``r`` on leaf ``r`` of its group (DGX-style rail optimisation).
"""

from __future__ import annotations


def _guid(kind: int, index: int) -> str:
    return f"{kind:04x}{index:012x}"


def fat_tree(leaves: int, spines: int, hosts_per_leaf: int, *, rails: int = 1,
             host_prefix: str = "gpu", width: int = 0) -> str:
    """A capture of ``leaves`` leaf switches, each linked to every spine.

    With ``rails`` > 1, leaves come in groups of ``rails``; each of the group's
    hosts has one HCA (``mlx5_<r>``) on every leaf of the group. Host numbers are
    zero-padded to ``width`` digits (0: enough for all hosts, at least 4).
    """
    if leaves % rails:
        raise ValueError(f"leaves ({leaves}) must be a multiple of rails ({rails})")
    leaf_ports = hosts_per_leaf + spines
    spine_desc = [f"MF0;spine{s + 1:03d}:MQM9700/U1" for s in range(spines)]
    leaf_desc = [f"MF0;leaf{i + 1:04d}:MQM9700/U1" for i in range(leaves)]
    width = width or max(4, len(str(leaves * hosts_per_leaf // rails)))
    out = ["#", "# Topology file: synthetic fat tree", "#", ""]
    hcas: list[str] = []
    for i in range(leaves):
        group, rail = divmod(i, rails)
        out += ["vendid=0x2c9", "devid=0xd2f0", f"switchguid=0x{_guid(1, i)}",
                f'Switch\t{leaf_ports} "S-{_guid(1, i)}"\t\t# "{leaf_desc[i]}" enhanced port 0 '
                f"lid {i + 1} lmc 0"]
        for h in range(hosts_per_leaf):
            host = f"{host_prefix}{group * hosts_per_leaf + h + 1:0{width}d}"
            hca = _guid(3, (group * hosts_per_leaf + h) * rails + rail)
            desc = f"{host} mlx5_{rail}"
            out.append(f'[{h + 1}]\t"H-{hca}"[1]({hca}) \t\t# "{desc}" lid {h + 100} 4xNDR')
            hcas += ["", "vendid=0x2c9", "devid=0x1021", f"caguid=0x{hca}",
                     f'Ca\t1 "H-{hca}"\t\t# "{desc}"',
                     f'[1]({hca})\t"S-{_guid(1, i)}"[{h + 1}]\t\t# lid {h + 100} lmc 0 '
                     f'"{leaf_desc[i]}" lid {i + 1} 4xNDR']
        for s in range(spines):
            out.append(f'[{hosts_per_leaf + s + 1}]\t"S-{_guid(2, s)}"[{i + 1}]\t\t# '
                       f'"{spine_desc[s]}" lid {5000 + s} 4xNDR')
        out.append("")
    for s in range(spines):
        out += ["vendid=0x2c9", "devid=0xd2f0", f"switchguid=0x{_guid(2, s)}",
                f'Switch\t{leaves} "S-{_guid(2, s)}"\t\t# "{spine_desc[s]}" enhanced port 0 '
                f"lid {5000 + s} lmc 0"]
        for i in range(leaves):
            out.append(f'[{i + 1}]\t"S-{_guid(1, i)}"[{hosts_per_leaf + s + 1}]\t\t# '
                       f'"{leaf_desc[i]}" lid {i + 1} 4xNDR')
        out.append("")
    return "\n".join(out + hcas) + "\n"
