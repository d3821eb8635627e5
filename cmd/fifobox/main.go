// Command fifobox is the operator CLI: migrate, status, dead list and
// requeue, DLQ redrive, replay, prune and the audit trail.
//
// Locally it talks to PostgreSQL (--database-url, FIFOBOX_DATABASE_URL) and
// to the transport FIFOBOX_TRANSPORT names (transport.Open): SQS at
// AWS_ENDPOINT_URL (the emulator, LocalStack or Floci) by default, RabbitMQ
// or NATS. Against AWS, --via-lambda FUNCTION sends the same JSON command to
// the redrive Lambda, which runs it inside the VPC next to RDS Proxy and
// audits it.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"os/user"
	"syscall"

	"github.com/aws/aws-sdk-go-v2/aws"
	lambdasvc "github.com/aws/aws-sdk-go-v2/service/lambda"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/spf13/cobra"

	"github.com/fifobox/fifobox/pkg/awsclient"
	"github.com/fifobox/fifobox/pkg/db"
	"github.com/fifobox/fifobox/pkg/redrive"
	"github.com/fifobox/fifobox/pkg/transport"

	// The transports FIFOBOX_TRANSPORT can name: each registers itself
	// with transport.Open.
	_ "github.com/fifobox/fifobox/pkg/transport/amqp"
	_ "github.com/fifobox/fifobox/pkg/transport/nats"
	"github.com/fifobox/fifobox/pkg/transport/sns"
)

// DefaultDatabaseURL is the local development database.
const DefaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/fifobox?sslmode=disable"

type app struct {
	databaseURL string
	viaLambda   string
	queuesJSON  string
	jsonOut     bool
	actor       string
	verbose     bool
	out, errOut io.Writer

	pool   *pgxpool.Pool
	awsCfg *aws.Config         // loaded once per process: IAM auth and the Lambda client share it
	tr     transport.Transport // opened once per process, closed with the pool
}

// aws returns the AWS SDK configuration, loading it on first use.
func (a *app) aws(ctx context.Context) (aws.Config, error) {
	if a.awsCfg == nil {
		c, err := awsclient.Load(ctx)
		if err != nil {
			return aws.Config{}, err
		}
		a.awsCfg = &c
	}
	return *a.awsCfg, nil
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	a := &app{out: os.Stdout, errOut: os.Stderr}
	root := a.rootCmd()
	if err := root.ExecuteContext(ctx); err != nil {
		fmt.Fprintln(os.Stderr, "fifobox:", err)
		os.Exit(1)
	}
}

func (a *app) rootCmd() *cobra.Command {
	root := &cobra.Command{
		Use:   "fifobox",
		Short: "Operate a fifobox outbox pipeline (PostgreSQL outbox -> SNS FIFO -> SQS FIFO consumers)",
		Long: `fifobox operates the outbox pipeline: schema migrations, backlog and queue status,
dead events, DLQ redrive, replay to one consumer, pruning. Every change is audited
in the redrive_audit table.

Locally it uses PostgreSQL (--database-url) and the transport FIFOBOX_TRANSPORT
names for status, replay, dlq-redrive, provision and consume: SQS at
AWS_ENDPOINT_URL (sns, the default), RabbitMQ (FIFOBOX_AMQP_URL,
FIFOBOX_AMQP_TOPOLOGY) or NATS JetStream (FIFOBOX_NATS_URL, FIFOBOX_NATS_TOPOLOGY).
Against AWS, --via-lambda FUNCTION runs the same command in the redrive Lambda.`,
		SilenceUsage:  true,
		SilenceErrors: true,
		PersistentPostRun: func(*cobra.Command, []string) {
			if a.tr != nil {
				_ = a.tr.Close()
			}
			if a.pool != nil {
				a.pool.Close()
			}
		},
	}
	def := os.Getenv("FIFOBOX_DATABASE_URL")
	if def == "" {
		def = DefaultDatabaseURL
	}
	host, _ := os.Hostname()
	who := "unknown"
	if u, err := user.Current(); err == nil {
		who = u.Username
	}
	pf := root.PersistentFlags()
	pf.StringVar(&a.databaseURL, "database-url", def, "PostgreSQL connection string (env FIFOBOX_DATABASE_URL)")
	pf.StringVar(&a.viaLambda, "via-lambda", os.Getenv("FIFOBOX_REDRIVE_FUNCTION"), "run the command in this redrive Lambda function (name or ARN; env FIFOBOX_REDRIVE_FUNCTION)")
	pf.StringVar(&a.queuesJSON, "queues", os.Getenv("FIFOBOX_QUEUES"), `with sns, consumer queues as JSON {"<consumer>":{"queue_url":"...","dlq_url":"...","subscription_dlq_url":"..."}} (env FIFOBOX_QUEUES; default: look up the topology's queue names)`)
	pf.BoolVar(&a.jsonOut, "json", false, "print the result as JSON")
	pf.StringVar(&a.actor, "actor", who+"@"+host, "who is asking, recorded in the audit trail")
	pf.BoolVarP(&a.verbose, "verbose", "v", false, "log operation details to stderr")
	root.AddCommand(a.migrateCmd(), a.statusCmd(), a.deadCmd(), a.redriveCmd(), a.releaseHoldsCmd(), a.replayCmd(), a.pruneCmd(), a.auditCmd(),
		a.provisionCmd(), a.consumeCmd())
	return root
}

// run executes a command locally or through the redrive Lambda.
func (a *app) run(ctx context.Context, cmd redrive.Command) (redrive.Result, error) {
	cmd.Actor = a.actor
	// The same guards the function applies, checked before anything is
	// sent or connected to.
	if err := cmd.Validate(); err != nil {
		return redrive.Result{}, err
	}
	if a.viaLambda != "" {
		return a.invoke(ctx, cmd)
	}
	svc, err := a.service(ctx, cmd.Operation)
	if err != nil {
		return redrive.Result{}, err
	}
	return svc.Execute(ctx, cmd)
}

func (a *app) logger() *slog.Logger {
	if a.verbose {
		return slog.New(slog.NewTextHandler(a.errOut, nil))
	}
	return slog.New(slog.NewTextHandler(io.Discard, nil))
}

func (a *app) connect(ctx context.Context) (*pgxpool.Pool, error) {
	if a.pool != nil {
		return a.pool, nil
	}
	cfg := db.Config{URL: a.databaseURL, MaxConns: 4}
	if os.Getenv("FIFOBOX_DATABASE_URL") == "" && os.Getenv("FIFOBOX_DB_HOST") != "" && a.databaseURL == DefaultDatabaseURL {
		// RDS Proxy settings in the environment (e.g. from a bastion).
		c, err := db.FromEnv()
		if err != nil {
			return nil, err
		}
		cfg = c
	}
	var creds aws.CredentialsProvider
	if cfg.IAMAuth {
		awsCfg, err := a.aws(ctx)
		if err != nil {
			return nil, err
		}
		creds = awsCfg.Credentials
	}
	pool, err := db.Open(ctx, cfg, creds)
	if err != nil {
		return nil, err
	}
	a.pool = pool
	return pool, nil
}

func (a *app) service(ctx context.Context, op string) (*redrive.Service, error) {
	pool, err := a.connect(ctx)
	if err != nil {
		return nil, err
	}
	cfg := redrive.Config{Logger: a.logger(), Progress: a.progress}
	if op == redrive.OpStatus || op == redrive.OpReplay || op == redrive.OpDLQRedrive {
		// The broker side of these goes through the transport, whichever it is.
		t, err := a.transport(ctx)
		if err != nil {
			return nil, err
		}
		if cfg.Operations, err = t.Operations(); err != nil {
			return nil, err
		}
	}
	return redrive.New(pool, cfg)
}

// transport opens the transport FIFOBOX_TRANSPORT names, once. --queues
// (sns) is its FIFOBOX_QUEUES.
func (a *app) transport(ctx context.Context) (transport.Transport, error) {
	if a.tr != nil {
		return a.tr, nil
	}
	if a.queuesJSON != os.Getenv(sns.EnvQueues) {
		if err := os.Setenv(sns.EnvQueues, a.queuesJSON); err != nil {
			return nil, err
		}
	}
	t, err := transport.Open(ctx, transport.Options{Logger: a.logger()})
	if err != nil {
		return nil, err
	}
	a.tr = t
	return t, nil
}

// invoke sends cmd to the redrive Lambda and decodes its result.
func (a *app) invoke(ctx context.Context, cmd redrive.Command) (redrive.Result, error) {
	awsCfg, err := a.aws(ctx)
	if err != nil {
		return redrive.Result{}, err
	}
	client := lambdasvc.NewFromConfig(awsCfg, func(o *lambdasvc.Options) { o.HTTPClient = awsclient.HTTPClient() })
	payload, _ := json.Marshal(cmd)
	fmt.Fprintf(a.errOut, "invoking %s: %s (runs synchronously; Lambda timeout applies)\n", a.viaLambda, cmd.Operation)
	out, err := client.Invoke(ctx, &lambdasvc.InvokeInput{FunctionName: aws.String(a.viaLambda), Payload: payload})
	if err != nil {
		return redrive.Result{}, fmt.Errorf("invoke %s: %w", a.viaLambda, err)
	}
	if out.FunctionError != nil {
		var fe struct {
			ErrorMessage string `json:"errorMessage"`
			ErrorType    string `json:"errorType"`
		}
		_ = json.Unmarshal(out.Payload, &fe)
		if fe.ErrorMessage == "" {
			fe.ErrorMessage = string(out.Payload)
		}
		return redrive.Result{}, fmt.Errorf("%s failed (%s): %s", a.viaLambda, aws.ToString(out.FunctionError), fe.ErrorMessage)
	}
	var res redrive.Result
	if err := json.Unmarshal(out.Payload, &res); err != nil {
		return redrive.Result{}, fmt.Errorf("decode %s response: %w", a.viaLambda, err)
	}
	return res, nil
}

func (a *app) progress(op string, done, total int64) {
	if total > 0 {
		fmt.Fprintf(a.errOut, "\r%s: %d/%d (%d%%)", op, done, total, done*100/total)
		if done >= total {
			fmt.Fprintln(a.errOut)
		}
		return
	}
	fmt.Fprintf(a.errOut, "\r%s: %d", op, done)
}

var errNoLocal = errors.New("this command needs a direct database connection; it is not available with --via-lambda")
