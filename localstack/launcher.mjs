// Starts the fauxqs SNS/SQS emulator for fifobox on 127.0.0.1 only, with
// request logging off (its CLI binds 0.0.0.0 and logs every request).
//   FIFOBOX_EMULATOR_PORT      port (default 4566, LocalStack's)
//   FIFOBOX_EMULATOR_DATA_DIR  if set, state persists there across restarts
//   FIFOBOX_EMULATOR_OWNERS    if set (tests: internal/emulatortest), a
//                              directory of owner pid files: the emulator
//                              exits once none of those processes is alive
//   FIFOBOX_EMULATOR_PIDFILE   removed at that exit if it holds this pid
import fs from "node:fs";
import net from "node:net";
import path from "node:path";

const host = "127.0.0.1";
const port = parseInt(process.env.FIFOBOX_EMULATOR_PORT ?? "4566", 10);
const dataDir = process.env.FIFOBOX_EMULATOR_DATA_DIR || undefined;

// fauxqs 2.4.1 listens on 0.0.0.0 whatever `host` says (dist/app.js calls
// app.listen({ port, host: "0.0.0.0" }); `host` only shapes queue URLs), so
// anyone on the network could read and write a developer's queues. Rather
// than patch node_modules, bind every TCP server this process opens to
// loopback. Fastify calls server.listen({ port, host, ... }, cb).
const listen = net.Server.prototype.listen;
net.Server.prototype.listen = function (...args) {
  const [first] = args;
  if (first !== null && typeof first === "object" && !(first instanceof net.Server) && first.path === undefined) {
    args[0] = { ...first, host };
  } else if (typeof first === "number" || (typeof first === "string" && /^\d+$/.test(first))) {
    // listen(port[, host][, backlog][, callback])
    if (typeof args[1] === "string") args[1] = host;
    else args.splice(1, 0, host);
  }
  return listen.apply(this, args);
};

const { startFauxqs } = await import("fauxqs");
const server = await startFauxqs({ port, host, logger: false, dataDir });
console.log(`fauxqs listening on http://${host}:${server.port}${dataDir ? ` (state in ${dataDir})` : ""}`);

async function exit(code) {
  const pidfile = process.env.FIFOBOX_EMULATOR_PIDFILE;
  try {
    if (pidfile && fs.readFileSync(pidfile, "utf8").trim() === String(process.pid)) fs.rmSync(pidfile);
  } catch {}
  process.exit(code);
}

for (const sig of ["SIGINT", "SIGTERM"]) {
  process.on(sig, () => exit(0));
}

// Owners: an emulator the tests started lives as long as the `go test`
// commands using it (their pids are files in the owners directory). The
// check runs under the same lock the tests take to register, so a test
// never registers with an emulator that is about to exit. The protocol is
// mirrored in internal/emulatortest (lock.go).
const owners = process.env.FIFOBOX_EMULATOR_OWNERS;
if (owners) {
  const alive = (pid) => {
    try {
      process.kill(pid, 0);
      return true;
    } catch (e) {
      return e.code === "EPERM";
    }
  };
  const lockDir = owners + ".lock";
  const tryLock = () => {
    try {
      fs.mkdirSync(lockDir);
      fs.writeFileSync(path.join(lockDir, "pid"), String(process.pid));
      return true;
    } catch (e) {
      if (e.code !== "EEXIST") throw e;
      let holder = 0;
      try {
        holder = parseInt(fs.readFileSync(path.join(lockDir, "pid"), "utf8"), 10);
      } catch {}
      const age = Date.now() - fs.statSync(lockDir, { throwIfNoEntry: false })?.mtimeMs;
      if ((holder && !alive(holder)) || (!holder && age > 10_000)) fs.rmSync(lockDir, { recursive: true, force: true });
      return false;
    }
  };
  const unlock = () => fs.rmSync(lockDir, { recursive: true, force: true });
  const check = async () => {
    if (!tryLock()) return;
    try {
      const live = fs
        .readdirSync(owners)
        .map(Number)
        .filter((pid) => pid > 0 && alive(pid));
      if (live.length > 0) return;
      console.log("fauxqs: every owner has exited; stopping");
      await server.stop();
      fs.rmSync(owners, { recursive: true, force: true });
    } catch (e) {
      if (e.code !== "ENOENT") throw e; // no owners directory: nobody registered, stop too
      await server.stop();
    } finally {
      unlock();
    }
    await exit(0);
  };
  setInterval(() => check().catch((e) => console.error("fauxqs: owner check failed:", e)), 1000);
}
