"""Side concerns of a training run, one Lightning callback each: graceful stop on a scheduler's notice, the stability
monitor, the rank monitor, the mixers' own metrics, progress (a bar, or plain lines off a terminal), the run
directory's lock, and the faults that tests inject. (In-loop evaluation, which runs lm-eval, lives with the evaluation
code: lm/eval/in_loop.py.)"""
