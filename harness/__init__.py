"""
harness -- what measures, checks and converts the models of this repository; the files at the root teach them.

    bench_*.py          the benchmarks behind `python bench.py X` (decode, plt, block, serve, train, kernels, gpu, ...)
    archs.py            the architecture table: every architecture's spec, and which of train.py's flags it reads
    checkpoint.py       checkpoint files (written atomically, read back verified) and the other model sources
                        (hf:DIR, gguf:PATH)
    run_flags.py        train.py's flags against a checkpoint (--resume, --init-from), the checks before a run starts
    curve.py            train.py's recovery curve (--curve-at, OUT_DIR/curve.jsonl)
    ddp.py              train.py under torchrun: its variables checked like flags, a rendezvous bounded in time
    cli.py, startup.py  the one error contract of every command (`error: ...` exit 2, `stopped: ...` exit 130), the
                        one safe write (a fresh temporary name, fsync, rename) and the one checked JSON reader
    memory.py           what a command will allocate, estimated before it allocates it (the memory checks)
    device.py           the device and dtype of --device / --dtype, known cards' peaks, the benchmarks' clock
    data.py, tasks.py   the tokenizer, corpora, token shards and batches; synthetic tasks that need depth
    plt_forms.py        PLT's loop-input and gate forms (the paper's, the remedy, LoopCoder's) trained side by side
    hf.py               a local Hugging Face checkpoint or a GGUF file into model.GPT (`python -m harness.hf DIR`)
    serve_requests.py   the requests the serving benchmark serves (synthetic, corpus, JSONL, chat)
    chat_template.py    a model's chat template rendered in a bounded child process (CPU time, memory, output)
    cpu_tuning.py       the CPU forms of linear, attention and LoRA measured fastest on this machine
    figures.py          each paper's central figure traced from the code (`python bench.py figures`)
    sweep.py            each quality comparison with both sides tuned on one budget (`python eval.py sweep NAME`)
    kernels_aot.py      kernels.py's Triton kernels compiled ahead of time for sm_80 / sm_90 without a GPU

Run its commands from the repository root (`python -m harness.hf ...`, `python -m harness.tasks ...`): the modules
import the root files (model.py, recursive.py, ...) by their plain names.
"""
