#!/usr/bin/python3
"""Ansible module: run `slurm-resilience install TARGET --json` and report it the Ansible way.

Check mode runs it with --dry-run (a preview, nothing written); --diff shows the
unified diff of the slurm.conf lines that change; state=absent runs --uninstall.
"""

from __future__ import annotations

import json
import os

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
module: slurm_resilience_install
short_description: Run C(slurm-resilience install TARGET) idempotently, with check mode and diff
description:
  - Runs the installed C(slurm-resilience install TARGET --json) and reports what it changed.
  - In check mode it runs with C(--dry-run); with C(state=absent) with C(--uninstall).
options:
  cli:
    description: Path of the installed slurm-resilience command.
    type: path
    required: true
  target:
    description: What to install.
    type: str
    required: true
    choices: [node, controller, spank, slurm-conf]
  args:
    description: Further arguments of C(install TARGET).
    type: list
    elements: str
    default: []
  state:
    description: C(present) installs, C(absent) uninstalls.
    type: str
    default: present
    choices: [present, absent]
author: slurm-resilience
"""


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "cli": {"type": "path", "required": True},
            "target": {"type": "str", "required": True,
                       "choices": ["node", "controller", "spank", "slurm-conf"]},
            "args": {"type": "list", "elements": "str", "default": []},
            "state": {"type": "str", "default": "present", "choices": ["present", "absent"]},
        },
        supports_check_mode=True,
    )
    p = module.params
    if not os.access(p["cli"], os.X_OK):
        if p["state"] == "absent":
            module.exit_json(changed=False, msg=f"{p['cli']} is not installed: nothing to remove")
        if module.check_mode:
            module.exit_json(changed=True, msg=f"{p['cli']} is not installed yet: "
                                               f"install {p['target']} would run after it is")
        module.fail_json(msg=f"{p['cli']} is missing; the package was not installed")
    argv = [p["cli"], "install", p["target"], "--json", *p["args"]]
    if p["target"] == "slurm-conf":
        argv.append("--diff")
    if p["state"] == "absent":
        argv.append("--uninstall")
    if module.check_mode:
        argv.append("--dry-run")
    rc, out, err = module.run_command(argv)
    if rc != 0:
        module.fail_json(msg=err.strip() or f"{' '.join(argv)} exited {rc}", rc=rc,
                         stdout=out, stderr=err, cmd=argv)
    try:
        report = json.loads(out)
    except ValueError:
        module.fail_json(msg=f"{' '.join(argv)} printed no JSON", stdout=out, stderr=err)
    result = {"changed": bool(report["changed"]), "files": report["files"], "cmd": argv}
    if report.get("diff"):
        result["diff"] = {"prepared": report["diff"]}
    module.exit_json(**result)


if __name__ == "__main__":
    main()
