package seeds_test

import (
	"bufio"
	"context"
	"io"
	"log/slog"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/fifobox/fifobox/internal/emulatortest"
	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/pkg/capture"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/wire"
)

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// clientsDir is examples/seeds, where the Node and Python clients live.
func clientsDir() string { return filepath.Join(emulatortest.RepoRoot(), "examples", "seeds") }

// missing skips the test for want, or fails it when FIFOBOX_REQUIRE_CLIENTS=1.
func missing(t *testing.T, want string) {
	t.Helper()
	if os.Getenv("FIFOBOX_REQUIRE_CLIENTS") == "1" {
		t.Fatalf("%s is not available (scripts/test.sh installs it)", want)
	}
	t.Skipf("%s is not available: run scripts/test.sh, or see examples/seeds", want)
}

// node returns Node with examples/seeds' npm packages installed.
func node(t *testing.T) string {
	t.Helper()
	if _, err := os.Stat(filepath.Join(clientsDir(), "node_modules", "amqplib")); err != nil {
		missing(t, "amqplib (npm ci in examples/seeds)")
	}
	for _, n := range []string{filepath.Join(emulatortest.RepoRoot(), "localstack", "node_modules", ".bin", "node"), "node"} {
		if p, err := exec.LookPath(n); err == nil {
			return p
		}
	}
	missing(t, "node")
	return ""
}

// python returns a Python 3 that imports every module.
func python(t *testing.T, modules ...string) string {
	t.Helper()
	imp := "import " + strings.Join(modules, ", ")
	for _, py := range []string{"/usr/bin/python3", "python3"} {
		if exec.Command(py, "-c", imp).Run() == nil {
			return py
		}
	}
	missing(t, "python3 with "+strings.Join(modules, ", ")+" (Debian python3-pika, python3-psycopg, python3-boto3)")
	return ""
}

// libpqURL connects a Node or Python client to the test's schema through
// libpq-style options, which node-postgres and psycopg both read.
func libpqURL(schema string) string {
	base := pgtest.URL()
	sep := "?"
	if strings.Contains(base, "?") {
		sep = "&"
	}
	return base + sep + "options=" + strings.ReplaceAll(url.QueryEscape("-c search_path="+schema), "+", "%20")
}

// proc is a client process whose output lines the test reads.
type proc struct {
	t     *testing.T
	name  string
	cmd   *exec.Cmd
	mu    sync.Mutex
	lines []string
	done  chan struct{}
	err   error
}

// start runs argv in dir with env added, collecting its stdout lines; the
// process is stopped when the test ends. With ready, start waits for a line
// "ready" first.
func start(t *testing.T, dir string, env []string, ready bool, argv ...string) *proc {
	t.Helper()
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), env...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr strings.Builder
	cmd.Stderr = &lockedWriter{w: &stderr}
	p := &proc{t: t, name: filepath.Base(argv[len(argv)-1]), cmd: cmd, done: make(chan struct{})}
	for _, a := range argv[1:] {
		if strings.Contains(a, ".") {
			p.name = a
			break
		}
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	readyc := make(chan struct{})
	go func() {
		sc := bufio.NewScanner(stdout)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		signalled := false
		for sc.Scan() {
			line := sc.Text()
			if !signalled && line == "ready" {
				signalled = true
				close(readyc)
				continue
			}
			p.mu.Lock()
			p.lines = append(p.lines, line)
			p.mu.Unlock()
		}
		p.err = cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(func() {
		// Stop the process group (the client and anything it started).
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGTERM)
		select {
		case <-p.done:
		case <-time.After(10 * time.Second):
			_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
			<-p.done
		}
		if t.Failed() {
			t.Logf("%s stderr:\n%s", p.name, stderr.String())
		}
	})
	if ready {
		select {
		case <-readyc:
		case <-p.done:
			t.Fatalf("%s exited before it was ready: %v\n%s", p.name, p.err, stderr.String())
		case <-time.After(2 * time.Minute):
			t.Fatalf("%s not ready after 2 minutes\n%s", p.name, stderr.String())
		}
	}
	return p
}

// wait waits for the process to exit by itself and returns its lines.
func (p *proc) wait(timeout time.Duration) []string {
	p.t.Helper()
	select {
	case <-p.done:
	case <-time.After(timeout):
		p.t.Fatalf("%s did not finish in %s", p.name, timeout)
	}
	if p.err != nil {
		p.t.Fatalf("%s: %v", p.name, p.err)
	}
	return p.output()
}

func (p *proc) output() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.lines...)
}

type lockedWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (l *lockedWriter) Write(b []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(b)
}

// dispatch runs fifobox's dispatcher on db through pub until the test
// ends; tune, if given, adjusts its configuration.
func dispatch(t *testing.T, db *pgtest.DB, pub outbox.Publisher, tune ...func(*outbox.DispatcherConfig)) {
	t.Helper()
	cfg := outbox.DispatcherConfig{BackoffBase: 20 * time.Millisecond, BackoffCap: 200 * time.Millisecond, Logger: quiet}
	for _, f := range tune {
		f(&cfg)
	}
	d, err := outbox.NewDispatcher(db.Pool, pub, cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); _ = d.Run(ctx) }()
	t.Cleanup(func() { cancel(); wg.Wait() })
}

// failFirst is a publisher that fails the first n attempts of the events
// in ids (a broker that refused them), then publishes through next.
func failFirst(next outbox.Publisher, n int, ids ...string) outbox.Publisher {
	fail := map[string]bool{}
	for _, id := range ids {
		fail[id] = true
	}
	return outbox.PublisherFunc(func(ctx context.Context, msgs []outbox.Message) []error {
		errs := make([]error, len(msgs))
		var pass []outbox.Message
		var idx []int
		for i, m := range msgs {
			if fail[m.EventID] && m.Attempt <= n {
				errs[i] = errTransient
				continue
			}
			pass, idx = append(pass, m), append(idx, i)
		}
		if len(pass) > 0 {
			for k, err := range next.Publish(ctx, pass) {
				errs[idx[k]] = err
			}
		}
		return errs
	})
}

type transientError struct{}

func (transientError) Error() string { return "test: the broker refused the publish (injected)" }

var errTransient = transientError{}

// eventually polls cond until it holds or the timeout passes.
func eventually(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// load returns a built-in profile.
func load(t *testing.T, name string) *wire.Profile {
	t.Helper()
	p, err := wire.Load(name)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// mapper compiles profile for transport.
func mapper(t *testing.T, p *wire.Profile, transport string) *wire.Mapper {
	t.Helper()
	m, err := p.Mapper(transport)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// producers gives the seed's producers their own schema with their outbox
// table as the document defines it (examples/seeds/<system>/<file>), and
// installs the profile's source (pkg/capture) so that fifobox, in db's
// schema, delivers every row they insert. The returned database's
// search_path holds only the producers' schema: their SQL runs as written,
// and a table of theirs named outbox is theirs.
func producers(t *testing.T, db *pgtest.DB, prof *wire.Profile, system, file string) *pgtest.DB {
	t.Helper()
	ctx := context.Background()
	ddl, err := os.ReadFile(filepath.Join(clientsDir(), system, file))
	if err != nil {
		t.Fatal(err)
	}
	app := pgtest.NewEmpty(t)
	if _, err := app.Pool.Exec(ctx, string(ddl)); err != nil {
		t.Fatalf("%s/%s: %v", system, file, err)
	}
	if _, err := capture.Install(ctx, app.Pool, prof, capture.InstallConfig{Schema: db.Schema}); err != nil {
		t.Fatal(err)
	}
	return app
}
