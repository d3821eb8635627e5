package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/fifobox/fifobox/internal/emulatortest"
	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/redrive"
	"github.com/fifobox/fifobox/pkg/topology"
	"github.com/fifobox/fifobox/pkg/transport/sns"
)

var (
	buildOnce sync.Once
	binPath   string
	buildErr  error
)

// buildCLI builds this command once per test process: the tests below run
// it as a real subprocess (exit codes, signals).
func buildCLI(t *testing.T) string {
	t.Helper()
	buildOnce.Do(func() {
		dir, err := os.MkdirTemp("", "fifobox-cli-")
		if err != nil {
			buildErr = err
			return
		}
		binPath = filepath.Join(dir, "fifobox")
		out, err := exec.Command("go", "build", "-o", binPath, "../../cmd/fifobox").CombinedOutput()
		if err != nil {
			buildErr = fmt.Errorf("go build: %v: %s", err, out)
		}
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return binPath
}

// cli is the command's environment for one test: its schema and its own
// topic and queues on an emulator.
type cli struct {
	bin string
	env []string
}

func newCLI(t *testing.T, endpoint string, dbURL string, extra ...string) *cli {
	c := &cli{bin: buildCLI(t)}
	for _, kv := range os.Environ() {
		// Only what the test sets: a developer's FIFOBOX_* must not leak in.
		if !strings.HasPrefix(kv, "FIFOBOX_") && !strings.HasPrefix(kv, "AWS_") {
			c.env = append(c.env, kv)
		}
	}
	c.env = append(c.env, "AWS_ENDPOINT_URL="+endpoint, "AWS_REGION=us-east-1", "AWS_ACCESS_KEY_ID=test", "AWS_SECRET_ACCESS_KEY=test",
		"FIFOBOX_DATABASE_URL="+dbURL)
	c.env = append(c.env, extra...)
	return c
}

// run runs the command to its end.
func (c *cli) run(t *testing.T, args ...string) (stdout, stderr string, code int) {
	t.Helper()
	cmd := exec.Command(c.bin, args...)
	cmd.Env = c.env
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	err := cmd.Run()
	if ee, ok := err.(*exec.ExitError); ok {
		return out.String(), errOut.String(), ee.ExitCode()
	}
	if err != nil {
		t.Fatal(err)
	}
	return out.String(), errOut.String(), 0
}

func queuesJSON(env *emulatortest.Env) string {
	q := sns.Queues{}
	for name, r := range env.Queues {
		q[name] = sns.QueueURLs{QueueURL: r.URL, DLQURL: r.DLQURL, SubscriptionDLQURL: r.SubDLQURL}
	}
	b, _ := json.Marshal(q)
	return string(b)
}

// With the emulator down, status still shows the outbox, says on stderr
// that the queues are unreachable and at which endpoint, and exits 1; its
// JSON says unreachable for the section and every queue. The emulator is
// a dedicated one on a port of its own, never the shared one.
func TestStatusWithTheEmulatorStoppedExitsNonZeroNamingTheEndpoint(t *testing.T) {
	t.Parallel()
	proc := emulatortest.StartProcess(t)
	topo := topology.Default()
	env := emulatortest.NewAt(t, proc.URL, topo, 0)
	db := pgtest.New(t)
	c := newCLI(t, proc.URL, pgtest.WithSearchPath(pgtest.URL(), db.Schema), "FIFOBOX_QUEUES="+queuesJSON(env))
	if out, errOut, code := c.run(t, "status"); code != 0 || !strings.Contains(out, "orders-projection  ok") {
		t.Fatalf("status with the emulator up: exit %d\n%s%s", code, out, errOut)
	}
	proc.Stop()
	// One attempt per call: the SDK's retries against the closed port
	// (seconds per queue) change nothing of what status reports.
	c.env = append(c.env, "AWS_MAX_ATTEMPTS=1")
	out, errOut, code := c.run(t, "status")
	if code != 1 {
		t.Fatalf("status with the emulator down: exit %d, want 1\n%s%s", code, out, errOut)
	}
	if !strings.Contains(errOut, "unreachable") || !strings.Contains(errOut, proc.URL) {
		t.Errorf("stderr does not name the unreachable endpoint %s:\n%s", proc.URL, errOut)
	}
	if !strings.Contains(out, "pending") || !strings.Contains(out, "unreachable") {
		t.Errorf("stdout lacks the outbox or the queues' state:\n%s", out)
	}
	out, _, code = c.run(t, "status", "--json")
	var res redrive.Result
	if err := json.Unmarshal([]byte(out), &res); err != nil || code != 1 || res.Status == nil {
		t.Fatalf("status --json: exit %d, %v:\n%s", code, err, out)
	}
	st := res.Status
	if st.State != redrive.StateDegraded || st.Outbox.State != redrive.StateOK || st.Queues.State != redrive.StateUnreachable || len(st.Queues.Consumers) != 3 {
		t.Fatalf("status %+v", st)
	}
	for _, q := range st.Queues.Consumers {
		if q.State != redrive.StateUnreachable || q.QueueState != redrive.StateUnreachable || q.DLQState != redrive.StateUnreachable ||
			q.Visible != -1 || !strings.Contains(q.Error, proc.URL) {
			t.Errorf("%s: %+v", q.Consumer, q)
		}
	}
}

// A queue that does not exist is "missing", per queue and for the
// section, and status exits 1; so is a consumer the topology lacks.
func TestStatusJSONSaysMissing(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ep := emulatortest.Endpoint(t)
	c := newCLI(t, ep, pgtest.WithSearchPath(pgtest.URL(), db.Schema), "FIFOBOX_SNS_NAME_PREFIX=nothere-"+db.Schema+"-")
	for _, args := range [][]string{{"status", "--json"}, {"status", "--json", "--consumer", "nope"}} {
		out, errOut, code := c.run(t, args...)
		var res redrive.Result
		if err := json.Unmarshal([]byte(out), &res); err != nil || code != 1 || res.Status == nil {
			t.Fatalf("%v: exit %d, %v:\n%s%s", args, code, err, out, errOut)
		}
		if res.Status.Queues.State != redrive.StateMissing || len(res.Status.Queues.Consumers) == 0 {
			t.Fatalf("%v: queues %+v", args, res.Status.Queues)
		}
		for _, q := range res.Status.Queues.Consumers {
			if q.State != redrive.StateMissing || q.QueueState != redrive.StateMissing || q.DLQ != -1 {
				t.Errorf("%v: %+v", args, q)
			}
		}
		if !strings.Contains(errOut, "missing") {
			t.Errorf("%v: stderr %q does not say missing", args, errOut)
		}
	}
}

// waitBlocked waits until a session waits for the lock the test's
// session (backend pid holder) holds: the subprocess is blocked mid-batch.
func waitBlocked(t *testing.T, db *pgtest.DB, holder int) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		var n int
		if err := db.Pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))`, holder).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n > 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("nothing ever waited on the test's lock")
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// process is a long-running subprocess.
type process struct {
	cmd  *exec.Cmd
	out  *syncBuffer
	done chan error
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func (c *cli) start(t *testing.T, args ...string) *process {
	t.Helper()
	p := &process{cmd: exec.Command(c.bin, args...), out: &syncBuffer{}, done: make(chan error, 1)}
	p.cmd.Env = c.env
	p.cmd.Stdout, p.cmd.Stderr = p.out, p.out
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { p.done <- p.cmd.Wait() }()
	t.Cleanup(func() {
		if p.cmd.ProcessState == nil {
			_ = p.cmd.Process.Kill()
		}
	})
	return p
}

// stop sends SIGTERM and waits for a clean exit.
func (p *process) stop(t *testing.T, release func()) {
	t.Helper()
	// A signal before it is up would kill it the default way: wait for its
	// running line.
	deadline := time.Now().Add(60 * time.Second)
	for !strings.Contains(p.out.String(), " running\"") {
		if time.Now().After(deadline) {
			t.Fatalf("never said it was running:\n%s", p.out)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if release != nil {
		// Still working on its batch after the signal: it must not have exited.
		select {
		case err := <-p.done:
			t.Fatalf("exited at SIGTERM with its batch unfinished (%v):\n%s", err, p.out)
		case <-time.After(300 * time.Millisecond):
		}
		release()
	}
	select {
	case err := <-p.done:
		if err != nil {
			t.Fatalf("exit after SIGTERM: %v\n%s", err, p.out)
		}
	case <-time.After(60 * time.Second):
		t.Fatalf("did not exit within 60s of SIGTERM:\n%s", p.out)
	}
}

// checkHealthy reads the process's health endpoint (from its log line)
// and liveness file.
func checkHealthy(t *testing.T, p *process, alive string) {
	t.Helper()
	re := regexp.MustCompile(`"msg":"health endpoint","addr":"([^"]+)"`)
	deadline := time.Now().Add(30 * time.Second)
	for {
		m := re.FindStringSubmatch(p.out.String())
		if m != nil {
			resp, err := http.Get("http://" + m[1] + "/healthz")
			if err == nil {
				body, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				if resp.StatusCode == 200 && strings.HasPrefix(string(body), "ok") {
					break
				}
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("never healthy on its endpoint:\n%s", p.out)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if _, err := os.Stat(alive); err != nil {
		t.Errorf("liveness file: %v", err)
	}
}

// holdRow locks one row until release is called; holder is the session's
// backend pid.
func holdRow(t *testing.T, db *pgtest.DB, sql string, args ...any) (holder int, release func()) {
	t.Helper()
	tx, err := db.Pool.Begin(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	var one int
	if err := tx.QueryRow(context.Background(), sql, args...).Scan(&one); err != nil {
		t.Fatal(err)
	}
	if err := tx.QueryRow(context.Background(), `SELECT pg_backend_pid()`).Scan(&holder); err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	release = func() { once.Do(func() { _ = tx.Rollback(context.Background()) }) }
	t.Cleanup(release)
	return holder, release
}

// holdClaimedHead waits until a claim has leased aggregate id's head and
// share-locks it until release is called, so the mark of that claim waits
// (the claim itself is not held: it has committed). holder is the
// session's backend pid.
func holdClaimedHead(t *testing.T, db *pgtest.DB, id string) (holder int, release func()) {
	t.Helper()
	ctx := context.Background()
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		tx, err := db.Pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		var one int
		// NOWAIT: while the claim is running its lock is still held.
		err = tx.QueryRow(ctx, `SELECT 1 FROM outbox_heads WHERE aggregate_id = $1 AND claim_token IS NOT NULL FOR SHARE NOWAIT`, id).Scan(&one)
		if err == nil {
			if err := tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&holder); err != nil {
				t.Fatal(err)
			}
			var once sync.Once
			release = func() { once.Do(func() { _ = tx.Rollback(context.Background()) }) }
			t.Cleanup(release)
			return holder, release
		}
		_ = tx.Rollback(ctx)
		time.Sleep(time.Millisecond)
	}
	t.Fatalf("no claim of %s's head seen in 30s", id)
	return 0, nil
}

// Run as long-running processes, the dispatcher and an SQS consumer each
// get SIGTERM while a batch is in hand (held on a row lock of the test:
// the dispatcher after publishing, before recording; the consumer inside
// its inbox transaction). Each finishes its batch and exits 0; after
// restarts every event is published once (attempts 1) and applied once.
func TestDispatchAndConsumeSurviveSIGTERMMidBatch(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	topo := topology.Default()
	topo.Consumers = topo.Consumers[:1] // orders-projection: the read model counts each event applied
	env := emulatortest.New(t, topo, 30)
	c := newCLI(t, env.Endpoint, pgtest.WithSearchPath(pgtest.URL(), db.Schema),
		"FIFOBOX_TOPIC_ARN="+env.TopicARN, "FIFOBOX_QUEUES="+queuesJSON(env), "FIFOBOX_POLL_INTERVAL=50ms", "FIFOBOX_METRICS_INTERVAL=1s")
	ctx := context.Background()
	const orders = 20
	var all []envelope.Envelope
	for step, typ := range []string{"order.created", "order.paid", "order.shipped"} {
		for o := range orders {
			id := fmt.Sprintf("order-%02d", o)
			e, err := envelope.New(typ, "order", id, map[string]any{"order_id": id, "customer_id": "c", "amount_cents": 100, "currency": "EUR"})
			if err != nil {
				t.Fatal(err)
			}
			all = append(all, e)
			_ = step
		}
	}
	for _, e := range all {
		if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error { return outbox.Enqueue(ctx, tx, e) }); err != nil {
			t.Fatal(err)
		}
	}

	// Dispatcher: stopped while its first batch is published but not yet
	// recorded (the mark waits on the test's lock of a claimed head: a
	// mark writes heads only, migrations/00030).
	d := c.start(t, "dispatch", "--liveness-file", filepath.Join(t.TempDir(), "alive"))
	holder, release := holdClaimedHead(t, db, "order-07")
	waitBlocked(t, db, holder)
	d.stop(t, release)
	if !strings.Contains(d.out.String(), "dispatcher stopped") {
		t.Errorf("dispatcher output lacks its stop line:\n%s", d.out)
	}
	var sent, maxAttempts int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE state = 'sent'), coalesce(max(attempts), 0) FROM outbox_events`).Scan(&sent, &maxAttempts); err != nil {
		t.Fatal(err)
	}
	if sent == 0 || maxAttempts != 1 {
		t.Fatalf("after SIGTERM: %d sent, attempts up to %d: want the batch recorded, each published once", sent, maxAttempts)
	}
	// A second dispatcher publishes the rest (none of it twice), and says
	// it is healthy on its endpoint and in its liveness file meanwhile.
	alive := filepath.Join(t.TempDir(), "alive")
	d = c.start(t, "dispatch", "--health-addr", "127.0.0.1:0", "--liveness-file", alive, "--health-interval", "100ms")
	deadline := time.Now().Add(60 * time.Second)
	for sent < len(all) && time.Now().Before(deadline) {
		time.Sleep(100 * time.Millisecond)
		_ = db.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox_events WHERE state = 'sent'`).Scan(&sent)
	}
	checkHealthy(t, d, alive)
	d.stop(t, nil)
	if _, err := os.Stat(alive); !os.IsNotExist(err) {
		t.Errorf("liveness file left behind after the stop: %v", err)
	}
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE state = 'sent'), max(attempts) FROM outbox_events`).Scan(&sent, &maxAttempts); err != nil || sent != len(all) || maxAttempts != 1 {
		t.Fatalf("%d of %d sent, attempts up to %d (%v)", sent, len(all), maxAttempts, err)
	}

	// Consumer: stopped while a batch waits inside its inbox transaction
	// (order-07's read-model row is locked by the test).
	if _, err := db.Pool.Exec(ctx, `INSERT INTO orders_read_model (order_id, status, last_sequence, event_count) VALUES ('order-07', 'new', 0, 0)`); err != nil {
		t.Fatal(err)
	}
	holder, release = holdRow(t, db, `SELECT 1 FROM orders_read_model WHERE order_id = 'order-07' FOR UPDATE`)
	r := c.start(t, "consume", "--consumer", "orders-projection")
	waitBlocked(t, db, holder)
	r.stop(t, release)
	if !strings.Contains(r.out.String(), "consumer stopped") {
		t.Errorf("consumer output lacks its stop line:\n%s", r.out)
	}
	r = c.start(t, "consume", "--consumer", "orders-projection")
	applied := 0
	deadline = time.Now().Add(90 * time.Second)
	for applied < len(all) && time.Now().Before(deadline) {
		time.Sleep(100 * time.Millisecond)
		_ = db.Pool.QueryRow(ctx, `SELECT count(*) FROM inbox WHERE consumer = 'orders-projection'`).Scan(&applied)
	}
	r.stop(t, nil)
	var rows, events, shipped int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*), sum(event_count), count(*) FILTER (WHERE status = 'shipped') FROM orders_read_model`).Scan(&rows, &events, &shipped); err != nil {
		t.Fatal(err)
	}
	if applied != len(all) || rows != orders || events != len(all) || shipped != orders {
		t.Fatalf("inbox %d, read model %d orders, %d events applied, %d shipped: want %d, %d, %d, %d (each event once)",
			applied, rows, events, shipped, len(all), orders, len(all), orders)
	}
}
