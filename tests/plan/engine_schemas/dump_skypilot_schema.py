"""Write the JSON schema SkyPilot validates task YAML with, for tests/plan/test_cluster_files.py.

SkyPilot cannot be installed beside finetune's test environment (it pins click<8.2 and bcrypt==4.0.1),
so run this in a separate venv:  python -m venv /tmp/sky && /tmp/sky/bin/pip install skypilot==0.14.1
&& /tmp/sky/bin/python tests/plan/engine_schemas/dump_skypilot_schema.py [plan/skypilot.yaml ...]
Files named on the command line are also loaded by SkyPilot's own `sky.Task.from_yaml`.
"""

import json
import sys
from importlib.metadata import version
from pathlib import Path

import sky
from sky.utils import schemas

target = Path(__file__).with_name(f"skypilot-{version('skypilot')}-task.schema.json")
target.write_text(json.dumps(schemas.get_task_schema(), indent=1, sort_keys=True) + "\n")
print(f"wrote {target}")
for path in sys.argv[1:]:
    task = sky.Task.from_yaml(path)
    print(f"{path}: sky.Task.from_yaml ok: {task.num_nodes} nodes, {task.resources}")
