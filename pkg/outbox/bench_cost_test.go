package outbox

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/internal/proccpu"
)

// backends records the PostgreSQL backend of every connection a benchmark's
// pools open, so the benchmark can read what PostgreSQL spent on its own
// statements (CPU of those backends) while other clients share the server.
type backends struct {
	mu   sync.Mutex
	pids []int
}

// pool opens a pool on db's schema whose connections report their backend.
func (b *backends) pool(tb testing.TB, db *pgtest.DB) *pgxpool.Pool {
	tb.Helper()
	cfg := db.Pool.Config().Copy()
	cfg.AfterConnect = func(ctx context.Context, c *pgx.Conn) error {
		b.mu.Lock()
		b.pids = append(b.pids, int(c.PgConn().PID()))
		b.mu.Unlock()
		return nil
	}
	p, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(p.Close)
	return p
}

// cpu is the CPU time the recorded backends have used so far.
func (b *backends) cpu() time.Duration {
	b.mu.Lock()
	defer b.mu.Unlock()
	return proccpu.Pids(b.pids...)
}

// outboxBytes is the size of the outbox table with its TOAST table and
// indexes.
func outboxBytes(tb testing.TB, db *pgxpool.Pool) int64 {
	tb.Helper()
	var n int64
	if err := db.QueryRow(context.Background(), `SELECT pg_total_relation_size('outbox')`).Scan(&n); err != nil {
		tb.Fatal(err)
	}
	return n
}

// cost is what one drain cost: PostgreSQL backend CPU per event and outbox
// bytes per event after the drain (before any vacuum or prune).
type cost struct {
	cpuPerEvent   float64 // microseconds
	bytesPerEvent float64
}

func median2(xs []cost) cost {
	var a, b []float64
	for _, x := range xs {
		a = append(a, x.cpuPerEvent)
		b = append(b, x.bytesPerEvent)
	}
	return cost{median(a), median(b)}
}

var benchCosts = map[string][]cost{}

func recordCost(name string, c cost) {
	benchMu.Lock()
	benchCosts[name] = append(benchCosts[name], c)
	benchMu.Unlock()
}
