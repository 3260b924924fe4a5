// OpenAI Agents SDK for JS: a streamed agent run with a function tool, on the Responses API.
import { Agent, run, setDefaultOpenAIClient, setOpenAIAPI, setTracingDisabled, tool } from "@openai/agents";
import OpenAI from "openai";
import { z } from "zod";

import { baseURL, scenario } from "./common.mjs";

await scenario(async (observed) => {
  setTracingDisabled(true);
  setOpenAIAPI("responses");
  setDefaultOpenAIClient(new OpenAI({ baseURL: baseURL(), apiKey: "sk-js-judge", maxRetries: 0 }));
  observed.executed = [];
  const getWeather = tool({
    name: "get_weather",
    description: "Get the weather for a city.",
    parameters: z.object({ city: z.string() }),
    execute: async ({ city }) => {
      observed.executed.push(city);
      return `It is sunny in ${city}.`;
    },
  });
  const agent = new Agent({ name: "Weather", instructions: "Answer with the tool.", model: "tiny",
                            tools: [getWeather] });
  const result = await run(agent, "What is the weather in Paris?", { stream: true });
  observed.events = [];
  observed.rawTypes = [];
  for await (const event of result) {
    if (event.type === "raw_model_stream_event") {
      const t = event.data?.type === "model" ? event.data.event?.type : event.data?.type;
      if (t && observed.rawTypes.at(-1) !== t) observed.rawTypes.push(t);
    } else if (event.type === "run_item_stream_event") {
      observed.events.push(`${event.name}:${event.item?.type}`);
    }
  }
  await result.completed;
  if (result.error) throw result.error;
  observed.finalOutput = result.finalOutput;
  observed.usage = result.state?.usage ?? null;
});
