package inbox_test

import (
	"context"
	"fmt"
	"net/url"
	"os"
	"sort"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/internal/proccpu"
	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/inbox"
	"github.com/fifobox/fifobox/pkg/readmodel"
)

// nopBroker settles nothing (the benchmark's records all apply).
type nopBroker struct{}

func (nopBroker) Ack(context.Context, *inbox.Record) error                          { return nil }
func (nopBroker) Retry(context.Context, *inbox.Record, inbox.Retry) error           { return nil }
func (nopBroker) DeadLetter(context.Context, *inbox.Record, inbox.DeadLetter) error { return nil }

// BenchmarkConsumer measures events/s through the consumer engine
// (inbox.Engine.Handle: batches of 10 records on one lane, as Lambda's SQS
// FIFO event source delivers them, 4 concurrent "instances"; strict order,
// so each batch also asks whether its groups are held) beside the same
// side effect (the orders read model upsert) applied the same way without
// the inbox: a transaction per batch, the side effects one after the other
// in it, which is what the engine does when nothing in a batch fails (its
// fast way, fast.go). One more line gives the same without the inbox but
// with a savepoint per record (the engine's shape before the fast way, the
// reference of the 1.30-1.40 x measured before issue 26), and one what
// row-level security (migration 00021) adds for a consumer confined to its
// own rows. Rates and CPU per event are medians of 3 interleaved rounds
// after a warm-up round.
//
//	go test -run '^$' -bench BenchmarkConsumer -benchtime 20000x ./pkg/inbox/
func BenchmarkConsumer(b *testing.B) {
	const instances = 4
	makeBodies := func(n int) [][]string {
		var out [][]string
		var cur []string
		for i := 0; i < n; i++ {
			id := fmt.Sprintf("order-%06d", i)
			e, _ := envelope.New("order.created", "order", id, readmodel.OrderEvent{OrderID: id, CustomerID: "c-1", AmountCents: 1200, Currency: "EUR"})
			e.Sequence = 1
			body, _ := e.Encode()
			cur = append(cur, string(body))
			if len(cur) == 10 {
				out = append(out, cur)
				cur = nil
			}
		}
		if len(cur) > 0 {
			out = append(out, cur)
		}
		return out
	}
	// CPU per event: this process and the PostgreSQL server's processes
	// (the postmaster of our backends and its children): on a private
	// cluster that is all the work, whatever else the machine runs.
	var postmaster int
	cpuNow := func() time.Duration { return proccpu.Self() + proccpu.Family(postmaster) }
	type figures struct{ rates, cpus []float64 }
	results := map[string]*figures{}
	run := func(b *testing.B, name string, record bool, batches [][]string, handle func([]string) error) {
		var next atomic.Int64
		var wg sync.WaitGroup
		cpu0 := cpuNow()
		start := time.Now()
		for w := 0; w < instances; w++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for {
					i := next.Add(1) - 1
					if int(i) >= len(batches) {
						return
					}
					if err := handle(batches[i]); err != nil {
						b.Error(err)
						return
					}
				}
			}()
		}
		wg.Wait()
		rate := float64(b.N) / time.Since(start).Seconds()
		b.ReportMetric(rate, "msgs/s")
		perEvent := float64((cpuNow() - cpu0).Microseconds()) / float64(b.N)
		b.ReportMetric(perEvent, "cpu-µs/msg")
		// The testing package's first call (b.N = 1) only calibrates.
		if record && b.N > 1 {
			f := results[name]
			if f == nil {
				f = &figures{}
				results[name] = f
			}
			f.rates = append(f.rates, rate)
			f.cpus = append(f.cpus, perEvent)
		}
	}
	median := func(xs []float64) float64 {
		s := append([]float64(nil), xs...)
		sort.Float64s(s)
		if len(s) == 0 {
			return 0
		}
		return s[len(s)/2]
	}
	engine := func(b *testing.B, db inbox.DB) func([]string) error {
		e, err := inbox.NewEngine(db, readmodel.Apply, inbox.EngineConfig{ConsumerConfig: inbox.ConsumerConfig{Consumer: "orders-projection",
			MaxBatch: 10, Logger: quietLog}, Lanes: 1, OrderedRedelivery: true})
		if err != nil {
			b.Fatal(err)
		}
		return func(bodies []string) error {
			recs := make([]*inbox.Record, len(bodies))
			for i, body := range bodies {
				recs[i] = &inbox.Record{ID: fmt.Sprint(i), Body: []byte(body), Deliveries: 1}
			}
			return e.Handle(context.Background(), nopBroker{}, recs)
		}
	}
	// without is the side effect applied without the inbox: a transaction
	// per batch, each body decoded and applied, a savepoint before each if
	// savepoints (so one record's failure could be undone alone).
	without := func(db *pgtest.DB, savepoints bool) func([]string) error {
		ctx := context.Background()
		return func(bodies []string) error {
			return pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
				for _, body := range bodies {
					e, err := envelope.Decode([]byte(body))
					if err != nil {
						return err
					}
					if savepoints {
						if _, err := tx.Exec(ctx, "SAVEPOINT record"); err != nil {
							return err
						}
					}
					if err := readmodel.Apply(ctx, tx, e); err != nil {
						return err
					}
				}
				return nil
			})
		}
	}
	// Interleaved rounds; round 0 only warms up (PostgreSQL's caches, the
	// Go runtime's heap).
	for round := 0; round <= 3; round++ {
		record := round > 0
		b.Run("without-inbox", func(b *testing.B) {
			db := pgtest.New(b)
			if postmaster == 0 {
				var backend int
				if err := db.Pool.QueryRow(context.Background(), "SELECT pg_backend_pid()").Scan(&backend); err != nil {
					b.Fatal(err)
				}
				postmaster = proccpu.Parent(backend)
			}
			batches := makeBodies(b.N)
			b.ResetTimer()
			run(b, "without", record, batches, without(db, false))
		})
		b.Run("with-inbox", func(b *testing.B) {
			db := pgtest.New(b)
			handle := engine(b, db.Pool)
			batches := makeBodies(b.N)
			b.ResetTimer()
			run(b, "with", record, batches, handle)
		})
		b.Run("without-inbox-savepoints", func(b *testing.B) {
			db := pgtest.New(b)
			batches := makeBodies(b.N)
			b.ResetTimer()
			run(b, "without-sp", record, batches, without(db, true))
		})
		b.Run("with-inbox-confined-user", func(b *testing.B) {
			db := pgtest.New(b)
			handle := engine(b, confinedPool(b, db, "orders-projection"))
			batches := makeBodies(b.N)
			b.ResetTimer()
			run(b, "confined", record, batches, handle)
		})
	}
	get := func(name string) (rate, cpu float64) {
		if f := results[name]; f != nil {
			return median(f.rates), median(f.cpus)
		}
		return 0, 0
	}
	with, cpuWith := get("with")
	wo, cpuWithout := get("without")
	sp, cpuSP := get("without-sp")
	confined, cpuConfined := get("confined")
	if with > 0 && wo > 0 {
		fmt.Fprintf(os.Stdout, "\nconsumer: %.0f msgs/s with the inbox (consumer engine), %.0f msgs/s same side effect without it: overhead %.2fx (targets: >= 2000 msgs/s, < 1.3x; medians of 3 rounds after a warm-up round)\n",
			with, wo, wo/with)
		fmt.Fprintf(os.Stdout, "  beside: without the inbox but a savepoint per record (the reference before issue 26) %.0f msgs/s (engine %.2fx); the engine as a consumer user confined by row-level security %.0f msgs/s (%.2fx)\n",
			sp, sp/with, confined, wo/confined)
		fmt.Fprintf(os.Stdout, "  CPU per event (this process + the PostgreSQL server's processes; medians): without %.0f µs, engine %.0f µs (%.2fx), without with savepoints %.0f µs, confined %.0f µs (%.2fx)\n\n",
			cpuWithout, cpuWith, cpuWith/cpuWithout, cpuSP, cpuConfined, cpuConfined/cpuWithout)
	}
}

// confinedPool is a pool on db's schema logged in as a fresh member of
// fifobox_consumer mapped to consumer alone (migration 00021's row-level
// security applies to it), dropped when the benchmark ends.
func confinedPool(b testing.TB, db *pgtest.DB, consumer string) *pgxpool.Pool {
	b.Helper()
	ctx := context.Background()
	user := db.Schema + "_bench"
	for _, q := range []string{
		fmt.Sprintf(`CREATE ROLE %s LOGIN IN ROLE fifobox_consumer`, pgx.Identifier{user}.Sanitize()),
	} {
		if _, err := db.Pool.Exec(ctx, q); err != nil {
			b.Fatal(err)
		}
	}
	if _, err := db.Pool.Exec(ctx, `INSERT INTO inbox_consumer_roles (role_name, consumer) VALUES ($1, $2)`, user, consumer); err != nil {
		b.Fatal(err)
	}
	u, err := url.Parse(db.URL)
	if err != nil {
		b.Fatal(err)
	}
	u.User = url.User(user)
	cfg, err := pgxpool.ParseConfig(u.String())
	if err != nil {
		b.Fatal(err)
	}
	cfg.MaxConns = 16
	cfg.ConnConfig.DefaultQueryExecMode = db.Pool.Config().ConnConfig.DefaultQueryExecMode
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		pool.Close()
		_, _ = db.Pool.Exec(context.Background(), fmt.Sprintf(`DROP OWNED BY %[1]s; DROP ROLE IF EXISTS %[1]s`, pgx.Identifier{user}.Sanitize()))
	})
	return pool
}
