package db_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/migrations"
	"github.com/fifobox/fifobox/pkg/db"
	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/inbox"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/outbox/outboxtest"
)

// TestThroughPgbouncerTransactionMode runs enqueue, dispatch and stats
// through pgbouncer in transaction pooling mode, with 8 client connections
// sharing 2 server connections: nothing may depend on session state
// (prepared statements, SET, advisory locks), exactly as behind RDS Proxy.
func TestThroughPgbouncerTransactionMode(t *testing.T) {
	bin, err := exec.LookPath("pgbouncer")
	if err != nil {
		if _, e := os.Stat("/usr/sbin/pgbouncer"); e != nil {
			t.Skip("pgbouncer not installed (apt-get install pgbouncer; .ci/run installs it)")
		}
		bin = "/usr/sbin/pgbouncer"
	}
	ctx := context.Background()
	admin, err := pgx.Connect(ctx, pgtest.URL())
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close(ctx)
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	dbName := "fbx_pgb_" + hex.EncodeToString(b)
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+dbName); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		c, err := pgx.Connect(context.Background(), pgtest.URL())
		if err == nil {
			_, _ = c.Exec(context.Background(), "DROP DATABASE IF EXISTS "+dbName+" WITH (FORCE)")
			c.Close(context.Background())
		}
	})
	direct, err := db.Open(ctx, db.Config{URL: fmt.Sprintf("postgres://postgres@127.0.0.1:5432/%s?sslmode=disable", dbName)}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer direct.Close()
	if err := migrations.Up(ctx, direct); err != nil {
		t.Fatal(err)
	}
	// PgBouncer 1.18 refuses search_path at connect, so db.Open connects
	// without it: the database's own default must name fifobox's schema, as
	// docs/operations.md tells pooler users to set it.
	if _, err := admin.Exec(ctx, fmt.Sprintf(`ALTER DATABASE %s SET search_path = %s, "$user", public`, dbName, db.DefaultSchema)); err != nil {
		t.Fatal(err)
	}

	port := freePort(t)
	dir, err := os.MkdirTemp("", "pgbouncer")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	_ = os.Chmod(dir, 0o777) // pgbouncer refuses to run as root: it runs as postgres
	ini := fmt.Sprintf(`[databases]
* = host=127.0.0.1 port=5432
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = %d
unix_socket_dir =
auth_type = trust
auth_file = %s/users.txt
pool_mode = transaction
default_pool_size = 2
max_client_conn = 100
logfile = %s/pgbouncer.log
`, port, dir, dir)
	write(t, filepath.Join(dir, "pgbouncer.ini"), ini)
	write(t, filepath.Join(dir, "users.txt"), `"postgres" ""`+"\n")
	cmd := exec.Command(bin, filepath.Join(dir, "pgbouncer.ini"))
	if os.Getuid() == 0 {
		// pgbouncer refuses to run as root: start it directly as postgres, so
		// the process we kill is pgbouncer itself (not a runuser wrapper).
		u, err := user.Lookup("postgres")
		if err != nil {
			t.Skipf("pgbouncer cannot run as root and there is no postgres user: %v", err)
		}
		uid, _ := strconv.Atoi(u.Uid)
		gid, _ := strconv.Atoi(u.Gid)
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}}
	}
	out := &lockedBuf{}
	cmd.Stdout, cmd.Stderr = out, out
	cmd.WaitDelay = 2 * time.Second
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	waitPort(t, port, out)

	pool, err := db.Open(ctx, db.Config{URL: fmt.Sprintf("postgres://postgres@127.0.0.1:%d/%s?sslmode=disable", port, dbName), MaxConns: 8}, nil)
	if err != nil {
		t.Fatalf("connect through pgbouncer: %v\n%s", err, out.String())
	}
	defer pool.Close()

	const aggregates, perAggregate = 40, 10
	var wg sync.WaitGroup
	for w := 0; w < 8; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			for i := 0; i < aggregates*perAggregate/8; i++ {
				id, _ := uuid.NewV7()
				e := envelope.Envelope{ID: id.String(), Type: "t.x", OccurredAt: time.Now(), AggregateType: "a",
					AggregateID: fmt.Sprintf("agg-%d", (w*7+i)%aggregates), SchemaVersion: 1, Payload: json.RawMessage(`{}`)}
				enqueue := func(tx pgx.Tx) error { return outbox.Enqueue(ctx, tx, e) }
				if w%2 == 1 { // half the producers through the SQL function (migrations/00013)
					enqueue = func(tx pgx.Tx) error {
						_, err := tx.Exec(ctx, `SELECT fifobox_enqueue(aggregate_type => $1, aggregate_id => $2, type => $3, payload => $4, id => $5)`,
							e.AggregateType, e.AggregateID, e.Type, string(e.Payload), e.ID)
						return err
					}
				}
				if err := pgx.BeginFunc(ctx, pool, enqueue); err != nil {
					t.Error(err)
					return
				}
			}
		}(w)
	}
	wg.Wait()
	rec := &outboxtest.Recorder{EntryFailRate: 0.1}
	var dwg sync.WaitGroup
	for i := 0; i < 3; i++ {
		d, err := outbox.NewDispatcher(pool, rec, outbox.DispatcherConfig{BatchSize: 50, BackoffBase: time.Millisecond, BackoffCap: 5 * time.Millisecond, MaxAttempts: 100})
		if err != nil {
			t.Fatal(err)
		}
		dwg.Add(1)
		go func() {
			defer dwg.Done()
			dctx, cancel := context.WithTimeout(ctx, 60*time.Second)
			defer cancel()
			for rec.Len() < aggregates*perAggregate && dctx.Err() == nil {
				if err := d.Drain(dctx); err != nil {
					t.Error(err)
					return
				}
				time.Sleep(5 * time.Millisecond)
			}
		}()
	}
	dwg.Wait()
	st, err := outbox.Stats(ctx, pool)
	if err != nil {
		t.Fatal(err)
	}
	if st.Pending != 0 || rec.Len() != aggregates*perAggregate {
		t.Fatalf("through pgbouncer: %d acknowledged, stats %+v", rec.Len(), st)
	}
	last := map[string]int64{}
	for _, a := range rec.Acks() {
		if a.Sequence != last[a.AggregateID]+1 {
			t.Fatalf("aggregate %s: %d after %d", a.AggregateID, a.Sequence, last[a.AggregateID])
		}
		last[a.AggregateID] = a.Sequence
	}
	// The consumer side: every acknowledged event processed through the
	// inbox twice, concurrently: each applied exactly once.
	var applied atomic.Int64
	var cwg sync.WaitGroup
	acks := rec.Acks()
	for copyN := 0; copyN < 2; copyN++ {
		for w := 0; w < 4; w++ {
			cwg.Add(1)
			go func(w int) {
				defer cwg.Done()
				for i := w; i < len(acks); i += 4 {
					e := envelope.Envelope{ID: acks[i].EventID, Type: "t.x", OccurredAt: time.Now(), AggregateType: "a",
						AggregateID: acks[i].AggregateID, Sequence: acks[i].Sequence, SchemaVersion: 1, Payload: json.RawMessage(`{}`)}
					_, err := inbox.Process(ctx, pool, "pgbouncer-test", e, func(context.Context, pgx.Tx) error {
						applied.Add(1)
						return nil
					})
					if err != nil {
						t.Error(err)
						return
					}
				}
			}(w)
		}
	}
	cwg.Wait()
	var rows int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM inbox WHERE consumer = 'pgbouncer-test'`).Scan(&rows); err != nil {
		t.Fatal(err)
	}
	if rows != len(acks) || applied.Load() != int64(len(acks)) {
		t.Fatalf("inbox has %d rows and ran %d side effects, want %d of each", rows, applied.Load(), len(acks))
	}
	t.Logf("%d events enqueued and dispatched in order, then each delivered twice to the inbox (%d side effects committed), through pgbouncer (transaction mode, 8 clients on 2 server connections)",
		rec.Len(), rows)
}

func write(t *testing.T, path, s string) {
	if err := os.WriteFile(path, []byte(s), 0o644); err != nil {
		t.Fatal(err)
	}
}

func freePort(t *testing.T) int {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

func waitPort(t *testing.T, port int, out *lockedBuf) {
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		if c, err := net.Dial("tcp", fmt.Sprintf("127.0.0.1:%d", port)); err == nil {
			c.Close()
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatalf("pgbouncer did not listen on %d: %s", port, out.String())
}

type lockedBuf struct {
	mu sync.Mutex
	b  []byte
}

func (l *lockedBuf) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.b = append(l.b, p...)
	return len(p), nil
}

func (l *lockedBuf) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return string(l.b)
}
