// Vercel AI SDK: openai.tools.applyPatch and openai.tools.shell (client-executed built-in tools) in a multi-step
// loop: the model creates a file, then runs a command, then answers. Store left on (its default), so later steps
// send earlier calls back as item_reference items. Streamed (streamText) by default; AI_SDK_MODE=generate
// runs the same loop with generateText.
import { createOpenAI } from "@ai-sdk/openai";
import { generateText, stepCountIs, streamText } from "ai";

import { baseURL, describeError, recordingFetch, requestSummary, scenario } from "./common.mjs";

await scenario(async (observed) => {
  const sent = [];
  const openai = createOpenAI({ baseURL: baseURL(), apiKey: "sk-js-judge", fetch: recordingFetch(sent) });
  observed.patches = [];
  observed.commands = [];
  observed.inputDeltas = [];
  observed.toolCalls = [];
  observed.errors = [];
  const run = process.env.AI_SDK_MODE === "generate" ? generateText : streamText;
  const result = await run({
    model: openai.responses("tiny"),
    prompt: "Create hello.txt, then show it.",
    tools: {
      apply_patch: openai.tools.applyPatch({
        execute: async ({ callId, operation }) => {
          observed.patches.push({ callId, operation });
          return { status: "completed", output: `created ${operation.path}` };
        },
      }),
      shell: openai.tools.shell({
        execute: async ({ action }) => {
          observed.commands.push(action.commands);
          return { output: [{ stdout: "hello\n", stderr: "", outcome: { type: "exit", exitCode: 0 } }] };
        },
      }),
    },
    stopWhen: stepCountIs(3),
    maxRetries: 0,
  });
  const parts = result.fullStream ?? result.steps.flatMap((step) => step.content.map((p) => ({ ...p })));
  for await (const part of parts) {
    if (part.type === "tool-input-delta") observed.inputDeltas.push(part.delta);
    if (part.type === "tool-call") {
      observed.toolCalls.push({ toolName: part.toolName, input: part.input, invalid: part.invalid ?? false,
                                itemId: part.providerMetadata?.openai?.itemId });
    }
    if (part.type === "error") observed.errors.push(describeError(part.error));
  }
  observed.requests = sent.map(requestSummary);
  observed.toolTypes = (sent[0]?.body?.tools ?? []).map((t) => t.type);
  observed.text = await result.text;
  observed.finishReason = await result.finishReason;
});
