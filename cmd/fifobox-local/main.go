// Command fifobox-local runs the fifobox pipeline locally against PostgreSQL
// and the transport FIFOBOX_TRANSPORT names: the SNS/SQS emulator by default
// (or LocalStack/Floci via AWS_ENDPOINT_URL), RabbitMQ or NATS JetStream:
// migrate, create the topology, run the dispatcher and a demo producer, and
// show events arriving in order at every consumer. `make local` runs it; the
// pipeline stays up after the demo until Ctrl-C (-exit-when-drained stops
// it once every event was applied, as the tests and CI want).
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/fifobox/fifobox/internal/localdemo"
	"github.com/fifobox/fifobox/migrations"
	"github.com/fifobox/fifobox/pkg/db"
	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/lambdafn/dispatcher"
	"github.com/fifobox/fifobox/pkg/metrics"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/readmodel"
	"github.com/fifobox/fifobox/pkg/topology"
	"github.com/fifobox/fifobox/pkg/transport"

	// The transports FIFOBOX_TRANSPORT can name: each registers itself
	// with transport.Open.
	_ "github.com/fifobox/fifobox/pkg/transport/amqp"
	_ "github.com/fifobox/fifobox/pkg/transport/nats"
	_ "github.com/fifobox/fifobox/pkg/transport/sns"
)

func main() {
	dbURL := flag.String("database-url", envOr("FIFOBOX_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/fifobox?sslmode=disable"), "PostgreSQL connection string (env FIFOBOX_DATABASE_URL)")
	orders := flag.Int("orders", 300, "orders to create (three events each)")
	rate := flag.Int("rate", 200, "business transactions per second")
	period := flag.Duration("schedule", 10*time.Second, "how often the local scheduler invokes the dispatcher handler")
	metricsPath := flag.String("metrics-log", ".data/metrics.emf.jsonl", "file for the functions' EMF metric lines")
	exit := flag.Bool("exit-when-drained", false, "stop once every event was applied (tests, CI); by default the pipeline stays up until Ctrl-C")
	flag.Parse()

	log := slog.New(slog.NewJSONHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	slog.SetDefault(log)
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	fi, _ := os.Stdout.Stat()
	opts := options{dbURL: *dbURL, orders: *orders, rate: *rate, period: *period, metricsPath: *metricsPath,
		out: os.Stdout, interactive: fi != nil && fi.Mode()&os.ModeCharDevice != 0, stayUp: !*exit}
	if err := run(ctx, opts, log); err != nil {
		fmt.Fprintln(os.Stderr, "fifobox-local:", err)
		os.Exit(1)
	}
}

// options of one run; main fills them from the flags.
type options struct {
	dbURL        string
	orders, rate int
	period       time.Duration
	metricsPath  string
	out          io.Writer
	interactive  bool // redraw the progress line in place (a terminal)
	stayUp       bool // keep running after the demo drained, until Ctrl-C
}

// run is the demo through whichever transport FIFOBOX_TRANSPORT names: its
// topology provisioned, the dispatcher Lambda's handler publishing through
// its publisher, and the default topology's consumers (orders-projection,
// shipping, audit) as its runners, applying the read model through the inbox.
func run(ctx context.Context, o options, log *slog.Logger) error {
	// pkg/db is what the Lambdas use: the same query mode as through RDS Proxy.
	pool, err := db.Open(ctx, db.Config{URL: o.dbURL, MaxConns: 16}, nil)
	if err != nil {
		return fmt.Errorf("connect to PostgreSQL: %w", err)
	}
	defer pool.Close()
	if err := migrations.Up(ctx, pool); err != nil {
		return err
	}
	// The demo's own table (the orders-projection consumer's read model).
	if err := readmodel.Setup(ctx, pool); err != nil {
		return err
	}
	t, err := transport.Open(ctx, transport.Options{Logger: log, Local: true})
	if err != nil {
		return err
	}
	defer t.Close()
	prov, err := t.Provisioner()
	if err != nil {
		return err
	}
	pctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	err = prov.Provision(pctx)
	cancel()
	if err != nil {
		return fmt.Errorf("create topology on %s: %w", t, err)
	}
	topo := topology.Default()
	fmt.Fprintf(o.out, "topology: %s\n", t)
	for _, c := range topo.Consumers {
		filter := c.FilterPolicy()
		if filter == "" {
			filter = "(all events)"
		}
		fmt.Fprintf(o.out, "  consumer %-20s filter %s\n", c.Name, filter)
	}
	pub, err := t.Publisher()
	if err != nil {
		return err
	}
	// The functions' EMF metric lines go to a file here (CloudWatch Logs in AWS).
	if err := os.MkdirAll(filepath.Dir(o.metricsPath), 0o755); err != nil {
		return err
	}
	mf, err := os.Create(o.metricsPath)
	if err != nil {
		return fmt.Errorf("metrics log: %w", err)
	}
	defer mf.Close()
	em := metrics.New(mf, "")

	// The real dispatcher handler, built as the Lambda's main.go builds it.
	var published atomic.Int64
	counting := outbox.PublisherFunc(func(ctx context.Context, msgs []outbox.Message) []error {
		errs := pub.Publish(ctx, msgs)
		for _, err := range errs {
			if err == nil {
				published.Add(1)
			}
		}
		return errs
	})
	dh, err := dispatcher.New(pool, counting, em, dispatcher.Config{Logger: log})
	if err != nil {
		return err
	}
	fmt.Fprintf(o.out, "demo: %d orders (created, paid, shipped; one transaction per step) at %d tx/s\n", o.orders, o.rate)
	fmt.Fprintf(o.out, "functions: dispatcher handler invoked every %s (deadline %s); consumers: %s runners (inbox + read model)\n",
		o.period, o.period+5*time.Second, t.Kind())
	fmt.Fprintf(o.out, "metrics: EMF lines in %s\n\n", o.metricsPath)
	return localdemo.Run(ctx, localdemo.Config{Orders: o.orders, Rate: o.rate, SchedulePeriod: o.period, Out: o.out, Interactive: o.interactive, StayUp: o.stayUp},
		localdemo.Deps{Pool: pool, Published: &published, Log: log, Topology: topo,
			Dispatch: func(ctx context.Context) (dispatcher.Result, error) { return dh.Handle(ctx, nil) },
			Runner: func(name string, obs localdemo.Observed) (transport.Runner, error) {
				apply := readmodel.ForConsumer(name)
				r, err := t.Consumer(name, pool, func(ctx context.Context, tx pgx.Tx, e envelope.Envelope) error {
					if err := apply(ctx, tx, e); err != nil {
						obs.Failed(err)
						return err
					}
					obs.Applied(e)
					return nil
				})
				if err != nil {
					return nil, fmt.Errorf("make local runs the default topology's consumers: %w", err)
				}
				return r, nil
			}})
}

func envOr(k, def string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return def
}
