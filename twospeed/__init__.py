"""twospeed: an LLM serving engine and latency lab that keeps prefill and decode apart."""

from twospeed.engine.request import Bill, Clock, RequestOutput
from twospeed.engine.sampling_params import SamplingParams
from twospeed.llm import LLM

__all__ = ["LLM", "SamplingParams", "RequestOutput", "Clock", "Bill"]
