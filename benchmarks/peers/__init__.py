"""Peers of raylora's engine that run in their own processes (issue: vLLM peer).

- vllm_peer.py: the launcher (standard library only, no vllm import): the workload file, the
  environment vLLM's CPU build wants, running a peer process with a timeout, its result.
- vllm_generate.py: vLLM's `LLM.generate` on a workload, run with .venv-vllm/bin/python
  (`make peer-vllm` builds that virtual environment).
- raylora_generate.py: raylora's engine on the same workload, run with .venv/bin/python, so
  that both engines pay their own start-up and neither shares allocator state.
- compare.py: the two alternated N times, each run, the median ratio, greedy agreement.
- procstats.py: start-up time and resident memory from /proc, the same for both.

(No module here is called vllm.py: a script in this folder has the folder first on sys.path,
and `import vllm` would find that file instead of vLLM.)
"""
