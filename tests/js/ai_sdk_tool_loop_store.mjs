// Vercel AI SDK: a two-turn function tool loop with the default store (store: true), so turn 2 sends
// `item_reference` input items for turn 1's stored output (the assistant message).
import { createOpenAI } from "@ai-sdk/openai";
import { generateText, stepCountIs, tool } from "ai";
import { z } from "zod";

import { baseURL, recordingFetch, requestSummary, scenario } from "./common.mjs";

await scenario(async (observed) => {
  const sent = [];
  const openai = createOpenAI({ baseURL: baseURL(), apiKey: "sk-js-judge", fetch: recordingFetch(sent) });
  observed.executed = [];
  const getWeather = tool({
    description: "Get the weather for a city.",
    inputSchema: z.object({ city: z.string() }),
    execute: async ({ city }) => {
      observed.executed.push(city);
      return { city, forecast: "sunny" };
    },
  });
  let result;
  try {
    result = await generateText({
      model: openai.responses("tiny"),
      prompt: "What is the weather in Paris?",
      tools: { get_weather: getWeather },
      stopWhen: stepCountIs(2),
      maxRetries: 0,
    });
  } finally {
    observed.requests = sent.map(requestSummary);
  }
  observed.steps = result.steps.map((step) => ({
    finishReason: step.finishReason,
    text: step.text,
    toolCalls: step.toolCalls.map((c) => ({ toolName: c.toolName, input: c.input })),
    responseId: step.response?.id,
  }));
  observed.text = result.text;
  observed.finishReason = result.finishReason;
  observed.usage = result.totalUsage;
});
