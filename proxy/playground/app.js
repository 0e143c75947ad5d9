// The chat playground: plain JavaScript, no dependencies, talks only to the page's own origin.
"use strict";
(() => {
  const TOKEN_KEY = "playground.token";  // sessionStorage: gone when the tab closes, never in a URL or cookie
  const $ = (id) => document.getElementById(id);
  const state = {conversation: [], controller: null};

  const savedToken = () => sessionStorage.getItem(TOKEN_KEY);
  const authHeaders = () => ({Authorization: `Bearer ${savedToken()}`});

  function setStatus(text, isError = false) {
    $("status").textContent = text;
    $("status").classList.toggle("error", isError);
  }

  function askToken(reason = "") {
    $("token-reason").textContent = reason;
    $("token-input").value = "";
    if (!$("token-dialog").open) $("token-dialog").showModal();
    $("token-input").focus();
  }

  function forgetToken(reason) {
    sessionStorage.removeItem(TOKEN_KEY);
    setStatus(reason, true);
    askToken(reason);
  }

  // --- errors as sentences -------------------------------------------------------------------------

  async function errorMessage(response) {
    const text = await response.text().catch(() => "");
    try {
      const body = JSON.parse(text);
      const error = body.error;
      return (error && (error.message || (typeof error === "string" && error))) || body.message || text;
    } catch {
      return text.trim().slice(0, 300) || response.statusText;
    }
  }

  function retrySeconds(header) {
    if (!header) return null;
    if (/^\d+$/.test(header.trim())) return Number(header.trim());
    const at = Date.parse(header);
    return Number.isNaN(at) ? null : Math.max(0, Math.ceil((at - Date.now()) / 1000));
  }

  function plural(n, word) {
    return `${n} ${word}${n === 1 ? "" : "s"}`;
  }

  function describe(status, message, retryAfter) {
    const why = message ? ` (${message.replace(/\.$/, "")})` : "";
    if (status === 401) return `The server did not accept your token${why}. Please enter a new one.`;
    if (status === 429 || status === 503) {
      const seconds = retrySeconds(retryAfter);
      const wait = seconds === null ? "a moment" : plural(seconds, "second");
      const busy = status === 429 ? "Too many requests are in progress for you" : "The server is busy";
      return `${busy}${why}. Please wait ${wait} and send again.`;
    }
    if (status === 403) return `Your token may not do this${why}.`;
    if (status === 404) return `The server does not know this${why}.`;
    if (status === 413) return "The conversation is too large to send. Start a new chat.";
    if (status >= 500) return `The server could not answer${why}. Try again in a moment.`;
    return `The server refused the request${why}.`;
  }

  // --- models --------------------------------------------------------------------------------------

  async function loadModels() {
    if (!savedToken()) return askToken();
    setStatus("Connecting…");
    let response;
    try {
      response = await fetch("v1/models", {headers: authHeaders()});
    } catch (err) {
      return setStatus(`Could not reach the server: ${err.message}. Is it running?`, true);
    }
    if (response.status === 401) return forgetToken(describe(401, await errorMessage(response)));
    if (!response.ok) {
      return setStatus(describe(response.status, await errorMessage(response), response.headers.get("Retry-After")), true);
    }
    const cards = (await response.json()).data || [];
    const models = cards.map((m) => m.id);
    const select = $("model");
    // a model not loaded yet loads at its first message (the server's status says which are)
    const label = (m) => (m.status && m.status.value && m.status.value !== "loaded" ? `${m.id} (${m.status.value})` : m.id);
    select.replaceChildren(...cards.map((m) => new Option(label(m), m.id)));
    if (!models.length) return setStatus("The server lists no model.", true);
    setStatus(`Connected. ${models.length === 1 ? models[0] : plural(models.length, "model")} ready.`);
    $("prompt").focus();
  }

  // --- the conversation ----------------------------------------------------------------------------

  function follow(change, always = false) {  // apply a change; keep the newest text in view unless the reader scrolled up
    const box = $("messages");
    const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 60;
    change();
    if (always || atBottom) box.scrollTop = box.scrollHeight;
  }

  function addMessage(role, text) {
    const li = document.createElement("li");
    li.className = role;
    const label = document.createElement("span");
    label.className = "role";
    label.textContent = role === "user" ? "You" : "Assistant";
    const body = document.createElement("p");
    body.className = "text";
    body.textContent = text;
    li.append(label, body);
    follow(() => $("messages").append(li), true);
    return {li, body};
  }

  function addNote(view, text, isError = false) {
    const note = document.createElement("p");
    note.className = isError ? "stats error" : "stats";
    note.textContent = text;
    follow(() => view.li.append(note));
  }

  function readParams() {
    const params = {};
    const number = (id, name, parse) => {
      const raw = $(id).value.trim();
      if (raw === "") return;
      const value = parse(raw);
      if (!Number.isFinite(value)) throw new Error(`${name} must be a number.`);
      params[name] = value;
    };
    number("temperature", "temperature", Number);
    number("top-p", "top_p", Number);
    number("max-tokens", "max_tokens", (v) => (/^\d+$/.test(v) ? Number(v) : NaN));
    number("seed", "seed", (v) => (/^-?\d+$/.test(v) ? Number(v) : NaN));
    const stop = $("stop").value.split("\n").filter((s) => s !== "");
    if (stop.length) params.stop = stop;
    return params;
  }

  function setBusy(busy) {
    $("send").disabled = busy;
    $("stop-button").hidden = !busy;
    $("model").disabled = busy;
  }

  const FINISH = {stop: "the model ended its answer or hit a stop string", length: "it reached the max tokens limit",
                  content_filter: "the server filtered it", tool_calls: "the model called a tool"};

  function rate(tokens, first, last) {
    return tokens > 1 && last > first ? ` · ${((tokens - 1) / ((last - first) / 1000)).toFixed(1)} tokens/s` : "";
  }

  const seconds = (ms) => `${(ms / 1000).toFixed(2)} s`;

  async function send() {
    const text = $("prompt").value;
    if (!text.trim() || state.controller) return;
    if (!savedToken()) return askToken("Enter your token to start chatting.");
    const model = $("model").value;
    if (!model) {
      setStatus("No model is listed yet; connecting again.", true);
      return loadModels();
    }
    let params;
    try {
      params = readParams();
    } catch (err) {
      return setStatus(err.message, true);
    }
    const system = $("system").value.trim();
    const conversation = state.conversation;  // "New chat" replaces it; this turn then ends on the old one
    conversation.push({role: "user", content: text});
    const messages = [...(system ? [{role: "system", content: system}] : []), ...conversation];
    if (matchMedia("(max-width: 480px)").matches) $("settings").open = false;  // room for the answer on a phone
    const userView = addMessage("user", text);
    $("prompt").value = "";
    const view = addMessage("assistant", "");
    view.li.setAttribute("aria-busy", "true");
    const takeBack = () => {  // nothing arrived: the turn is undone and the text goes back to the input
      conversation.pop();
      userView.li.remove();
      view.li.remove();
      if (!$("prompt").value) $("prompt").value = text;
    };

    const controller = new AbortController();
    state.controller = controller;
    setBusy(true);
    setStatus("Waiting for the first token…");
    const started = performance.now();
    let first = null, last = null, pieces = 0, answer = "", finish = null, usage = null, done = false;
    let failure = null, stopped = false;
    try {
      const response = await fetch("v1/chat/completions", {
        method: "POST", signal: controller.signal,
        headers: {...authHeaders(), "Content-Type": "application/json", Accept: "text/event-stream"},
        body: JSON.stringify({model, messages, stream: true, stream_options: {include_usage: true}, ...params}),
      });
      if (!response.ok) {
        const sentence = describe(response.status, await errorMessage(response), response.headers.get("Retry-After"));
        takeBack();
        if (response.status === 401) forgetToken(sentence);
        else setStatus(sentence, true);
        return;
      }
      const reader = response.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      for (;;) {
        const {value, done: ended} = await reader.read();
        if (ended) break;
        buffer += decoder.decode(value, {stream: true});
        let cut;
        while ((cut = buffer.search(/\r?\n\r?\n/)) >= 0) {
          const block = buffer.slice(0, cut);
          buffer = buffer.slice(cut).replace(/^\r?\n\r?\n/, "");
          const data = block.split(/\r?\n/).filter((line) => line.startsWith("data:"))
            .map((line) => line.slice(5).replace(/^ /, "")).join("\n");
          if (!data) continue;
          if (data === "[DONE]") { done = true; continue; }
          let chunk;
          try { chunk = JSON.parse(data); } catch { continue; }
          if (chunk.error) {
            failure = `The server failed in the middle of the answer (${chunk.error.message || chunk.error}).`;
            continue;
          }
          if (chunk.usage) usage = chunk.usage;
          for (const choice of chunk.choices || []) {
            const piece = choice.delta && choice.delta.content;
            if (piece) {
              last = performance.now();
              if (first === null) first = last;
              pieces += 1;
              answer += piece;
              follow(() => { view.body.textContent = answer; });
            }
            if (choice.finish_reason) finish = choice.finish_reason;
          }
          if (first !== null) {
            setStatus(`Answering… first token after ${seconds(first - started)}${rate(pieces, first, last)}`);
          }
        }
      }
      if (!done && !failure) failure = "The connection closed before the answer was complete.";
    } catch (err) {
      if (err.name === "AbortError") stopped = true;
      else failure = `The connection broke (${err.message}).`;
    } finally {
      state.controller = null;
      setBusy(false);
      view.li.removeAttribute("aria-busy");
    }

    if (conversation !== state.conversation) return;  // the chat was cleared meanwhile
    if (!answer && (stopped || (failure && !finish))) {
      takeBack();
      setStatus(stopped ? "Stopped before the first token." : `${failure} Nothing arrived; send again.`, !stopped);
      return;
    }
    conversation.push({role: "assistant", content: answer});
    const tokens = usage ? usage.completion_tokens : pieces;
    const counts = usage ? ` · ${plural(usage.prompt_tokens, "prompt token")}, ${plural(usage.completion_tokens, "completion token")}`
                         : ` · about ${plural(pieces, "token")}`;
    const timing = first === null ? "" : ` · first token after ${seconds(first - started)}${rate(tokens, first, last)}`;
    if (stopped) {
      addNote(view, `Stopped by you after ${plural(pieces, "token")}${timing}.`);
      setStatus("Stopped.");
    } else if (failure) {
      addNote(view, `${failure} What arrived is kept above.`, true);
      setStatus(failure, true);
    } else {
      addNote(view, `Finished: ${finish || "done"}${FINISH[finish] ? ` (${FINISH[finish]})` : ""}${counts}${timing}.`);
      setStatus("");
    }
  }

  function newChat() {
    if (state.controller) state.controller.abort();
    state.conversation = [];
    $("messages").replaceChildren();
    setStatus("");
    $("prompt").focus();
  }

  // --- wiring --------------------------------------------------------------------------------------

  $("token-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const value = $("token-input").value.trim().replace(/^Bearer\s+/i, "");
    if (!value) return;
    sessionStorage.setItem(TOKEN_KEY, value);
    $("token-dialog").close();
    loadModels();
  });
  $("token-dialog").addEventListener("close", () => {
    if (!savedToken()) setStatus("The page needs a token to chat: press Token to enter one.", true);
  });
  $("chat-form").addEventListener("submit", (event) => {
    event.preventDefault();
    send();
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      send();
    }
  });
  document.addEventListener("keydown", (event) => {
    if (event.key === "Escape" && state.controller && !$("token-dialog").open) state.controller.abort();
  });
  $("stop-button").addEventListener("click", () => state.controller && state.controller.abort());
  $("new-chat").addEventListener("click", newChat);
  $("change-token").addEventListener("click", () => askToken());

  setBusy(false);
  if (savedToken()) loadModels();
  else askToken();
})();
