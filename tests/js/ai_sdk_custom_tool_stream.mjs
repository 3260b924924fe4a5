// Vercel AI SDK: a streamed custom tool call (openai.tools.customTool) through the Responses API.
import { createOpenAI } from "@ai-sdk/openai";
import { streamText } from "ai";

import { baseURL, describeError, scenario } from "./common.mjs";

const GRAMMAR = 'start: "*** Begin Patch\\n" /(.|\\n)+/';

await scenario(async (observed) => {
  const openai = createOpenAI({ baseURL: baseURL(), apiKey: "sk-js-judge" });
  const result = streamText({
    model: openai.responses("tiny"),
    prompt: "Add a file hello.txt that says hello.",
    tools: {
      write_patch: openai.tools.customTool({
        description: "Apply a patch.",
        format: { type: "grammar", syntax: "lark", definition: GRAMMAR },
      }),
    },
    toolChoice: { type: "tool", toolName: "write_patch" },
    maxRetries: 0,
  });
  observed.parts = [];
  observed.inputDeltas = [];
  observed.toolCalls = [];
  observed.errors = [];
  for await (const part of result.fullStream) {
    observed.parts.push(part.type);
    if (part.type === "tool-input-start") observed.inputStart = { id: part.id, toolName: part.toolName };
    if (part.type === "tool-input-delta") observed.inputDeltas.push(part.delta);
    if (part.type === "tool-call") {
      observed.toolCalls.push({ toolCallId: part.toolCallId, toolName: part.toolName, input: part.input,
                                invalid: part.invalid ?? false, itemId: part.providerMetadata?.openai?.itemId });
    }
    if (part.type === "error") observed.errors.push(describeError(part.error));
    if (part.type === "finish") {
      observed.finishReason = part.finishReason;
      observed.usage = part.totalUsage;
    }
  }
});
