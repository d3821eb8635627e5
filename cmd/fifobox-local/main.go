// Command fifobox-local runs the fifobox pipeline locally against PostgreSQL
// and the SNS/SQS emulator (or LocalStack/Floci via AWS_ENDPOINT_URL):
// migrate, create the topology, run the dispatcher and a demo producer, and
// show events arriving in order in every queue. `make local` runs it.
package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/fifobox/fifobox/internal/localdemo"
	"github.com/fifobox/fifobox/migrations"
	"github.com/fifobox/fifobox/pkg/awsclient"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/outbox/snspub"
	"github.com/fifobox/fifobox/pkg/topology"
	"github.com/fifobox/fifobox/pkg/topology/provision"
)

func main() {
	dbURL := flag.String("database-url", envOr("FIFOBOX_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/fifobox?sslmode=disable"), "PostgreSQL connection string (env FIFOBOX_DATABASE_URL)")
	orders := flag.Int("orders", 300, "orders to create (three events each)")
	rate := flag.Int("rate", 200, "business transactions per second")
	flag.Parse()

	log := slog.New(slog.NewJSONHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	slog.SetDefault(log)
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, *dbURL, *orders, *rate, log); err != nil {
		fmt.Fprintln(os.Stderr, "fifobox-local:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, dbURL string, orders, rate int, log *slog.Logger) error {
	if os.Getenv("AWS_ENDPOINT_URL") == "" {
		return fmt.Errorf("AWS_ENDPOINT_URL is not set: source localstack/env.sh (make local does)")
	}
	pool, err := pgxpool.New(ctx, dbURL)
	if err != nil {
		return fmt.Errorf("connect to PostgreSQL: %w", err)
	}
	defer pool.Close()
	if err := migrations.Up(ctx, pool); err != nil {
		return err
	}
	cfg, err := awsclient.Load(ctx)
	if err != nil {
		return err
	}
	snsc, sqsc := awsclient.SNS(cfg), awsclient.SQS(cfg)
	topo := topology.Default()
	pctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	res, err := provision.Provision(pctx, snsc, sqsc, topo, provision.Options{VisibilityTimeoutSeconds: 30})
	cancel()
	if err != nil {
		return fmt.Errorf("create topology at %s: %w", os.Getenv("AWS_ENDPOINT_URL"), err)
	}
	fmt.Printf("topology: topic %s\n", res.TopicARN)
	for _, c := range topo.Consumers {
		q := res.Queues[c.Name]
		filter := c.FilterPolicy()
		if filter == "" {
			filter = "(all events)"
		}
		fmt.Printf("  queue %-26s filter %-34s DLQ %s after %d receives\n", q.Name, filter, c.DLQName(), c.MaxReceiveCount)
	}
	pub, err := snspub.New(snsc, snspub.Config{TopicARN: res.TopicARN})
	if err != nil {
		return err
	}
	d, err := outbox.NewDispatcher(pool, pub, outbox.DispatcherConfig{Logger: log})
	if err != nil {
		return err
	}
	fi, _ := os.Stdout.Stat()
	interactive := fi != nil && fi.Mode()&os.ModeCharDevice != 0
	fmt.Printf("demo: %d orders (created, paid, shipped; one transaction per step) at %d tx/s\n\n", orders, rate)
	return localdemo.Run(ctx, localdemo.Config{Orders: orders, Rate: rate, Out: os.Stdout, Interactive: interactive},
		localdemo.Deps{Pool: pool, SQS: sqsc, Resources: res, Dispatcher: d, Log: log})
}

func envOr(k, def string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return def
}
