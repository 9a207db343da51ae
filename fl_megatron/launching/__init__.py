"""Starting and stopping local process trees, for the launchers in tools/ and the tests (a leaf:
nothing else in fl_megatron imports it).

- commands: a command to start, started in its own session with its output in a log file
- tree: a process's descendants from /proc, and stopping processes with all of theirs
- ports: a free port, and waiting until something listens at an address
- lighthouse: torchft's lighthouse command, started and waited for
- group_logs: the lines of the elastic groups' logs a launcher shows, followed as they grow
"""
