"""placeholder"""
from .schedules import Action, Plan, ScheduleError, make_plan, validate_plan  # noqa: F401
from .simulator import Simulation, min_microbatches, simulate  # noqa: F401
from .wire import wait_sends  # noqa: F401
from .autograd_p2p import send_forward, recv_forward  # noqa: F401
from .stage import PipelineStage, balance, split_sequential  # noqa: F401
from .runtime import ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, ScheduleZeroBubble, schedule_class  # noqa: F401
