"""A complete custom tool env: convert units with a `convert` tool, answer the number (run it to play the oracle)."""
from types import SimpleNamespace

import gymnasium as gym

from k3rl.chat import Message
from k3rl.envs import ToolEnv, ToolError, tool
from k3rl.rollout.episode import run_oracle_episode

FACTORS = {("km", "m"): 1000, ("m", "cm"): 100, ("kg", "g"): 1000, ("h", "min"): 60}


class UnitsEnv(ToolEnv):
    """Convert a quantity to another unit; reward 1 for the exact number."""

    default_max_turns = 3

    def generate_task(self, rng, options):
        (src, dst), factor = list(FACTORS.items())[int(rng.integers(len(FACTORS)))]
        value = int(rng.integers(1, 100))
        return SimpleNamespace(id=f"{value}{src}->{dst}", value=value, src=src, dst=dst, answer=value * factor)

    def opening_messages(self, task):
        return [Message(role="user", content=f"How many {task.dst} is {task.value} {task.src}?")]

    @tool
    def convert(self, value: float, src: str, dst: str) -> str:
        """Convert a value from one unit to another, e.g. km to m."""
        if (src, dst) not in FACTORS:
            raise ToolError(f"cannot convert {src} to {dst}; known: {sorted(FACTORS)}")
        return f"{value * FACTORS[src, dst]:g}"

    def score(self, final_text):  # terminal reward of the final answer (a message without tool calls)
        return 1.0 if final_text.strip() == str(self.task.answer) else 0.0

    def oracle(self, history=None):  # scripted policy: call the tool, then repeat its result
        last = self._messages(history)[-1]
        if last.role == "tool" and not last.content.startswith("Error"):
            return self.say(last.content)
        t = self.task
        return self.say(tool_calls=[{"name": "convert", "arguments": {"value": t.value, "src": t.src, "dst": t.dst}}])


gym.register("examples/Units-v0", entry_point=UnitsEnv)

if __name__ == "__main__":
    env = gym.make("examples/Units-v0")
    print(run_oracle_episode(env, seed=0).reward, env.unwrapped.transcript(), sep="\n")
