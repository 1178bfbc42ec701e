"""Commands on models and configs: example, inspect, convert, parity, init, schema, plan,
balance."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import typer

from moepipe.cli._app import (
    ConfigOpt,
    ExampleName,
    Goal,
    JsonOpt,
    PlanFormat,
    _echo,
    _emit,
    _say,
    app,
)
from moepipe.config import Dtype, KvCacheFormat, QuantFormat, Target, field_help
from moepipe.errors import ConfigError


@app.command()
def example(name: ExampleName = typer.Argument(..., help="A built-in example."),
            out: Path = typer.Option(..., "--out", help="Folder to create."),
            overwrite: bool = typer.Option(False, "--overwrite")) -> None:
    """Write a built-in tiny checkpoint (HF format, with a real tokenizer): seeded random
    weights, or (*-trained) trained once per machine on the shipped corpus."""
    from moepipe.examples import write_example

    write_example(name, out, overwrite=overwrite, progress=logging.getLogger("moepipe").info)
    _echo(f"wrote {name} to {out}")


@app.command("inspect")
def inspect_cmd(model: Path = typer.Argument(..., help="Hugging Face checkpoint folder."),
                as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
                max_gpus: int = typer.Option(8, "--max-gpus",
                                             help="Largest world size to list.")) -> None:
    """Architecture, sizes, parameter counts and the legal parallel mappings of a checkpoint."""
    from moepipe.stages.inspect import format_inspection, inspect_checkpoint

    result = inspect_checkpoint(model, max_gpus)
    typer.echo(json.dumps(result.data, indent=2) if as_json else format_inspection(result.data))


@app.command()
def convert(model: Path = typer.Option(..., "--model", help="Hugging Face checkpoint folder."),
            output: Path = typer.Option(..., "--output", help="TensorRT-LLM checkpoint folder."),
            dtype: Dtype = typer.Option("auto", "--dtype", help=field_help("model.dtype")),
            tp: int = typer.Option(1, "--tp", help=field_help("parallel.tp")),
            pp: int = typer.Option(1, "--pp", help=field_help("parallel.pp")),
            moe_tp: int | None = typer.Option(None, "--moe-tp",
                                              help=field_help("parallel.moe_tp")),
            moe_ep: int | None = typer.Option(None, "--moe-ep",
                                              help=field_help("parallel.moe_ep")),
            workers: int = typer.Option(1, "--workers", help=field_help("convert.workers")),
            overwrite: bool = typer.Option(False, "--overwrite"),
            as_json: bool = JsonOpt) -> None:
    """Convert a Hugging Face MoE checkpoint into a sharded TensorRT-LLM checkpoint."""
    from moepipe.conversion.write import convert as run_convert

    res = run_convert(model, output, dtype=dtype, tp=tp, pp=pp, moe_tp=moe_tp, moe_ep=moe_ep,
                      workers=workers, overwrite=overwrite)
    m = res.plan.mapping
    if as_json:
        _emit({"output": str(output.resolve()), "world_size": m.world_size, "tp": m.tp,
               "pp": m.pp, "moe_tp": m.moe_tp, "moe_ep": m.moe_ep, "dtype": res.plan.dtype,
               "bytes_written": res.bytes_written, "seconds": round(res.seconds, 3)})
        return
    _echo(f"wrote {output}: {m.world_size} rank(s) ({m.describe()}), {res.plan.dtype}, "
          f"{res.bytes_written / 2**20:.1f} MiB in {res.seconds:.2f}s")


@app.command()
def parity(hf: Path = typer.Option(..., "--hf", help="Source Hugging Face checkpoint."),
           checkpoint: Path = typer.Option(..., "--checkpoint",
                                           help="Converted TensorRT-LLM checkpoint."),
           prompt: list[str] | None = typer.Option(None, "--prompt",
                                                      help="Prompt (repeatable)."),
           max_new_tokens: int = typer.Option(16, "--max-new-tokens"),
           tolerance: float = typer.Option(1e-4, "--tolerance",
                                           help="Max abs logit difference allowed."),
           as_json: bool = typer.Option(False, "--json")) -> None:
    """Compare a converted checkpoint with Hugging Face transformers: logits and greedy tokens."""
    from moepipe.validate.parity import check_parity

    report = check_parity(hf, checkpoint, prompt, max_new_tokens, tolerance)
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
    else:
        for p in report.prompts:
            typer.echo(f"  {p.prompt[:48]!r:52} max|dlogit| {p.max_abs_diff:.2e}  greedy "
                       f"{len(p.moepipe_tokens)} tokens "
                       f"{'match' if p.tokens_match else 'DIFFER'}")
        verdict = "PASS" if report.passed else "FAIL"
        typer.echo(f"parity {verdict}: max |logit diff| {report.max_abs_diff:.2e} "
                   f"(tolerance {tolerance:g}) vs transformers")
    if not report.passed:
        raise typer.Exit(1)


@app.command()
def init(model: Path | None = typer.Option(None, "--model", help=field_help("model.path")),
         example_name: ExampleName | None = typer.Option(
             None, "--example", metavar="NAME",
             help=f"{field_help('model.example')} (`moepipe example --help` lists them)"),
         target: Target = typer.Option("cpu", "--target", help=field_help("target")),
         tp: int = typer.Option(1, "--tp", help=field_help("parallel.tp")),
         pp: int = typer.Option(1, "--pp", help=field_help("parallel.pp")),
         moe_tp: int | None = typer.Option(None, "--moe-tp", help=field_help("parallel.moe_tp")),
         moe_ep: int | None = typer.Option(None, "--moe-ep", help=field_help("parallel.moe_ep")),
         quantize: QuantFormat = typer.Option("none", "--quantize",
                                              help=field_help("quantize.format")),
         kv_cache: KvCacheFormat = typer.Option("none", "--kv-cache",
                                                help=field_help("quantize.kv_cache")),
         use_plan: bool = typer.Option(False, "--plan", help="Fill parallel and build limits "
                                       "from the best `moepipe plan` for --cluster."),
         cluster: str = typer.Option("8xH100", "--cluster", help="With --plan: GPUSxKIND or "
                                     "NODESxGPUSxKIND (A100-40, A100-80, H100, H200, B200, "
                                     "L40S)."),
         isl: int = typer.Option(2048, "--isl", help="With --plan: input tokens per request."),
         osl: int = typer.Option(512, "--osl", help="With --plan: output tokens per request."),
         goal: Goal = typer.Option("throughput", "--goal", help="With --plan: what to rank "
                                   "by."),
         force: bool = typer.Option(False, "--force", help="Overwrite an existing file."),
         config: Path = typer.Option(Path("moepipe.yaml"), "-c", "--config",
                                     help="File to write."),
         as_json: bool = JsonOpt) -> None:
    """Write a commented moepipe.yaml here, and its JSON Schema beside it for editors."""
    from moepipe.commands.init import run_init

    made = run_init(config, model=model, example=example_name, target=target, tp=tp, pp=pp,
                    moe_tp=moe_tp, moe_ep=moe_ep, quantize=quantize, kv_cache=kv_cache,
                    force=force, plan={"cluster": cluster, "isl": isl, "osl": osl,
                                       "goal": goal} if use_plan else None)
    say, par = _say(as_json), made["parallel"]
    if made["note"]:
        say(f"parallel: tp={par['tp']} pp={par['pp']} moe_tp={par['moe_tp']} moe_ep="
            f"{par['moe_ep']} attention_dp={str(par['attention_dp']).lower()} ({made['note']})")
    say(f"wrote {config} (and its schema {Path(made['schema']).name}); next: moepipe build")
    if as_json:
        _emit(made)


@app.command()
def schema(out: Path | None = typer.Option(None, "--out", help="Write it to this file "
                                           "(default: stdout).")) -> None:
    """The JSON Schema of moepipe.yaml, from the config model (editors, CI checks)."""
    from moepipe.commands.init import config_schema
    from moepipe.utils.fs import write_text_atomic

    text = json.dumps(config_schema(), indent=2) + "\n"
    if out is None:
        typer.echo(text, nl=False)
        return
    write_text_atomic(out, text)
    _echo(f"wrote {out}")


@app.command("plan")
def plan_cmd(model: str = typer.Argument(..., help="Checkpoint folder, config.json, a built-in "
                                         "example or a published model: Mixtral-8x7B, "
                                         "Qwen3-30B-A3B, Qwen3-235B-A22B, DeepSeek-V3."),
             cluster: str = typer.Option("8xH100", "--cluster", help="GPUSxKIND or "
                                         "NODESxGPUSxKIND; KIND: A100-40, A100-80, H100, H200, "
                                         "B200, L40S."),
             isl: int = typer.Option(2048, "--isl", help="Input tokens per request."),
             osl: int = typer.Option(512, "--osl", help="Output tokens per request."),
             goal: Goal = typer.Option("throughput", "--goal", help="What to rank by."),
             quantize: PlanFormat = typer.Option("auto", "--quantize", help="Weight format "
                                                 "(auto: as published)."),
             kv_cache: KvCacheFormat = typer.Option("none", "--kv-cache",
                                                    help="KV-cache format."),
             kv_fraction: float = typer.Option(0.9, "--kv-fraction", help="Share of the free "
                                               "GPU memory the KV cache takes."),
             target: Target = typer.Option("trtllm-pytorch", "--target",
                                           help="The target to plan for."),
             max_num_tokens: int = typer.Option(8192, "--max-num-tokens",
                                                help="Tokens per engine step."),
             nvlink_gbps: float | None = typer.Option(None, "--nvlink-gbps",
                                                      help="NVLink GB/s per direction."),
             internode_gbps: float | None = typer.Option(None, "--internode-gbps",
                                                         help="Network GB/s per GPU."),
             usd_per_gpu_hour: float | None = typer.Option(
                 None, "--usd-per-gpu-hour", help="Price of one GPU per hour: adds US$ per "
                 "million output tokens per mapping (roofline) and for the dense model of the "
                 "same parameters."),
             as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
             write: Path | None = typer.Option(None, "--write", help="Also write "
                                               "aiconfigurator's inputs into this folder."),
             top: int = typer.Option(12, "--top", min=1, help="Rows of the table.")) -> None:
    """Which parallel mapping fits a cluster: weights, KV cache, traffic, ranked for a goal."""
    from moepipe.commands.plan import PlanRequest, model_id, run_plan, to_json
    from moepipe.planner.aic import write_aiconfigurator
    from moepipe.planner.report import format_plan

    result = run_plan(PlanRequest(model, cluster, isl, osl, goal, quantize, kv_cache,
                                  kv_fraction, target, max_num_tokens, nvlink_gbps,
                                  internode_gbps, usd_per_gpu_hour))
    written = None
    if write is not None:
        written = write_aiconfigurator(result, model_id(model), write)
    typer.echo(to_json(result) if as_json else format_plan(result, top))
    if written is not None:
        _echo(f"wrote {written}; run: aiconfigurator cli exp --yaml-path {written}")


@app.command("balance")
def balance_cmd(metrics: str | None = typer.Option(None, "--metrics", help="A deployment's "
                                                   "metrics URL (default, with a config: its "
                                                   "own, http://HOST:METRICS_PORT/metrics)."),
                counts: Path | None = typer.Option(None, "--counts", help="Expert token "
                                                   "counts: JSON {\"layers\": {\"0\": [...]}},"
                                                   " saved metrics text, or the folder "
                                                   "TensorRT-LLM's expert statistics wrote "
                                                   "(read with the config's mapping)."),
                moe_ep: int | None = typer.Option(None, "--moe-ep", help="EP ranks (default: "
                                                  "the config's parallel.moe_ep)."),
                slots: int | None = typer.Option(None, "--slots", help="Expert slots per "
                                                 "layer (default: experts + moe_ep)."),
                out: Path = typer.Option(Path("expert-placement.yaml"), "--out",
                                         help="Placement file to write."),
                config: Path | None = ConfigOpt,
                as_json: bool = typer.Option(False, "--json", help="Print the prediction as "
                                             "JSON.")) -> None:
    """Expert placement from measured load for TensorRT-LLM's MoE load balancer."""
    from moepipe.commands.plan import dump_mapping, format_balance, run_balance

    dump = None
    folder = counts is not None and counts.is_dir()
    if moe_ep is None or (metrics is None and counts is None) or folder:
        from moepipe.config import DEFAULT_CONFIG, load_config

        if folder and not (config or Path(DEFAULT_CONFIG)).is_file():
            raise ConfigError(f"--counts {counts}: a folder is read as TensorRT-LLM's expert "
                              "statistics, with the mapping of the deployment that wrote it",
                              "pass -c with that deployment's moepipe.yaml")
        cfg = load_config(config)
        moe_ep = moe_ep or cfg.parallel.to_mapping().moe_ep
        if metrics is None and counts is None:
            metrics = f"http://{cfg.deploy.host}:{cfg.deploy.metrics_port}/metrics"
        dump = dump_mapping(cfg) if folder else None
    placement = run_balance(metrics, counts, moe_ep, slots, out, dump)
    typer.echo(json.dumps(placement.summary(), indent=2) if as_json
               else format_balance(placement, out))
