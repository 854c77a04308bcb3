"""eyas recipe: the whole pipeline for a bundled target (eyas/recipe.py)."""

from __future__ import annotations

import typer

from .common import DeviceOpt, user_errors


def recipe(
    name: str = typer.Argument("smollm2-135m", help="the recipe (target) to run"),
    work: str = typer.Option("runs/recipe", "--work", help="work folder (resume by rerunning the same command)"),
    stages: str = typer.Option("data,ngram,train,eval,ship", "--stages", help="subset of data,ngram,train,eval,ship"),
    device: str = DeviceOpt,
    orig_num: int = typer.Option(4000, "--orig-num", help="ShareGPT rows with original replies"),
    regen_num: int = typer.Option(0, "--regen-num", help="ShareGPT rows, target-regenerated"),
    regen_start: int = typer.Option(0, "--regen-start", help="regenerate from this source row on, into "
                                    "WORK/data-regen-from-ROW (new conversations for another round)"),
    self_num: int = typer.Option(0, "--self-num", help="rows whose user turn the target writes too (datagen --data "
                                 "self), into WORK/data-self"),
    self_start: int = typer.Option(0, "--self-start", help="self-prompted rows from this row on, into "
                                   "WORK/data-self-from-ROW"),
    epochs: float = typer.Option(5.0, "--epochs"),
    ttt_steps: int = typer.Option(3, "--ttt-steps"),
    draft_vocab: int = typer.Option(8192, "--draft-vocab"),
    lr: float = typer.Option(1e-3, "--lr"),
    batch_tokens: int = typer.Option(2048, "--batch-tokens", help="padded tokens per optimizer step"),
    bf16: bool = typer.Option(None, "--bf16/--no-bf16", help="bf16 autocast in training (default: on CUDA only)"),
    threads: int = typer.Option(0, "--threads", help="torch CPU threads (0 = torch's default)"),
    ship_to: str = typer.Option(None, "--ship-to", help="default: eyas/assets/drafts/default"),
    init_from: str = typer.Option(None, "--init-from", help="warm-start training from this eyas draft ('default' = "
                                  "the shipped one; keeps its draft vocabulary)"),
    refresh_vocab: bool = typer.Option(False, "--refresh-vocab", help="with --init-from: re-choose the draft "
                                       "vocabulary from the current data"),
    ngram_min_count: int = typer.Option(2, "--ngram-min-count", help="ngram stage: keep a context whose most "
                                        "frequent next token was seen this often"),
) -> None:
    """Run the whole pipeline (datagen -> ngram -> train -> bench -> ship) for a bundled target; resumable at every
    stage."""
    from ..recipe import RecipeConfig, run_recipe

    with user_errors():
        run_recipe(RecipeConfig(name=name, work=work, stages=tuple(s for s in stages.split(",") if s), device=device,
                                orig_num=orig_num, regen_num=regen_num, regen_start=regen_start, self_num=self_num,
                                self_start=self_start, epochs=epochs,
                                ttt_steps=ttt_steps,
                                draft_vocab=draft_vocab, lr=lr, batch_tokens=batch_tokens, bf16=bf16, threads=threads,
                                ship_to=ship_to, init_from=init_from, refresh_vocab=refresh_vocab,
                                ngram_min_count=ngram_min_count))

