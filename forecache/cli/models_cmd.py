"""``forecache models``: the names ``-m`` accepts and where their files are."""

from __future__ import annotations

import json

import click


@click.command("models")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def models(as_json: bool) -> None:
    """List the model names -m accepts, whether their files are found, and how to get them."""
    from forecache.gguf.specs import load_specs
    from forecache.models.default import ensure_default_model
    from forecache.models.names import catalog, find_in_model_dir
    from forecache.models.pull import pulled_models
    from forecache.paths import model_dir

    directory = model_dir()
    rows = [{"name": "default", "kind": "built-in", "path": str(ensure_default_model()),
             "found": True, "description": "forecache's trained reference model"}]
    listed = set()
    for entry in catalog().values():
        found = find_in_model_dir(entry, directory)
        listed.add(found)
        rows.append({"name": entry.name, "kind": "published", "found": found is not None,
                     "path": str(found or directory / entry.file), "hf_repo": entry.hf_repo,
                     "description": entry.description})
    for spec, path in pulled_models(directory):
        if path not in listed:  # a catalog model pulled is listed by its name above
            rows.append({"name": spec, "kind": "pulled", "found": True, "path": str(path),
                         "hf_repo": spec.partition(":")[0],
                         "description": "pulled from the Hugging Face hub"})
    for spec in load_specs().values():
        # a dense preset is a draft for speculative decoding, not a MoE model to run
        kind = ("random-weight draft" if spec.is_dense else
                "random-weight shape" if spec.writable else "simulator shape")
        rows.append({"name": spec.name, "kind": kind, "found": None,
                     "path": None, "description": spec.description})
    if as_json:
        click.echo(json.dumps({"model_dir": str(directory), "models": rows}))
        return
    click.echo(f"model directory: {directory} (FORECACHE_MODEL_DIR overrides it)")
    for r in rows:
        if r["kind"] == "published":
            if r["found"]:
                where = f"found: {r['path']}"
            elif r["hf_repo"]:
                where = (f"missing: `forecache pull {r['name']}` downloads it from "
                         f"huggingface.co/{r['hf_repo']}")
            else:
                where = f"missing: put {r['path']} there"
        elif r["kind"] == "pulled":
            where = f"pulled: {r['path']}"
        elif r["kind"] == "built-in":
            where = r["path"]
        elif r["kind"] == "simulator shape":
            where = "shape for the simulator (make-model cannot write it)"
        elif r["kind"] == "random-weight draft":
            where = (f"dense draft for --draft: `forecache make-model --preset {r['name']}` "
                     "writes it")
        else:
            where = "shape for `forecache make-model --preset " + r["name"] + "`"
        click.echo(f"  {r['name']:<26} {where}")


COMMANDS = [models]
