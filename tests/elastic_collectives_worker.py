"""A torchrun worker for test_elastic_collectives.py: fl_megatron.pretrain with every collective of
the training loop recorded (the trainer's phase and step, the op, its process group's global ranks
where c10d knows them, this rank's payload bytes) into $FL_TEST_COLLECTIVES/group_G_rank_R.json.
Only the main thread is seen (a dispatch mode is per thread): blocking syncs only."""

import json
import os
import sys
from pathlib import Path

from fl_megatron import pretrain
from fl_megatron.federation.ledger import CollectiveCounter
from fl_megatron.training import trainer as trainer_module


def _recorded(train):
    def recorded_train(self):
        events = []
        with CollectiveCounter(lambda name, ranks, nbytes: events.append(
                (self.phases.phase, self.phases.step, name, ranks, nbytes))):
            result = train(self)
        name = f"group_{self.group}_rank_{os.environ['RANK']}.json"
        (Path(os.environ["FL_TEST_COLLECTIVES"]) / name).write_text(json.dumps(events))
        return result
    return recorded_train


if __name__ == "__main__":
    trainer_module.Trainer.train = _recorded(trainer_module.Trainer.train)
    sys.exit(pretrain.main(sys.argv[1:]))
