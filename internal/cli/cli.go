// Package cli is the fifobox operator CLI (cmd/fifobox is its main): every
// operation of the redrive Lambda (redrive.Ops: migrate, status, dead
// list/requeue/discard, retry-now, redrive, dlq list/peek/discard,
// release-holds, replay, prune, audit), and the long-running processes
// (dispatch, consume) and provision.
//
// Locally it talks to PostgreSQL (--database-url, FIFOBOX_DATABASE_URL) and
// to the transport FIFOBOX_TRANSPORT names (transport.Open): SQS at
// AWS_ENDPOINT_URL (the emulator, LocalStack or Floci) by default, RabbitMQ
// or NATS. Against AWS, --via-lambda FUNCTION sends the same JSON command to
// the redrive Lambda, which runs it inside the VPC next to RDS Proxy and
// audits it. A command that cannot do what it was asked, or a status
// section that cannot be read, says why on stderr (and in --json) and exits 1.
package cli

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
	"strings"
	"syscall"

	"github.com/aws/aws-sdk-go-v2/aws"
	lambdasvc "github.com/aws/aws-sdk-go-v2/service/lambda"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/fifobox/fifobox/pkg/awsclient"
	"github.com/fifobox/fifobox/pkg/db"
	"github.com/fifobox/fifobox/pkg/inbox"
	"github.com/fifobox/fifobox/pkg/lambdafn"
	"github.com/fifobox/fifobox/pkg/outbox"
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
	// in is where confirmations are read; interactive says it is a terminal
	// (and errOut too: progress redraws in place).
	in          io.Reader
	interactive bool

	root   *cobra.Command
	pool   *pgxpool.Pool
	awsCfg *aws.Config         // loaded once per process: IAM auth and the Lambda client share it
	tr     transport.Transport // opened once per process, closed with the pool
	prog   *progress
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

// Main runs the CLI with the process's arguments, streams and signals,
// and returns its exit code: 0, or 1 after printing why on stderr.
func Main() int {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	go func() {
		// The first signal stops gracefully; a second one kills at once.
		<-ctx.Done()
		stop()
	}()
	a := &app{out: os.Stdout, errOut: os.Stderr, in: os.Stdin, interactive: isTerminal(os.Stdin) && isTerminal(os.Stderr)}
	root := a.rootCmd()
	err := root.ExecuteContext(ctx)
	a.close()
	if err != nil {
		fmt.Fprintln(os.Stderr, "fifobox:", err)
		return 1
	}
	return 0
}

// Run runs one command line (without "fifobox") with the given streams,
// in the current environment, as the command would: what the docs tests
// use to produce documented output.
func Run(ctx context.Context, out, errOut io.Writer, args ...string) error {
	a := &app{out: out, errOut: errOut, in: strings.NewReader("")}
	root := a.rootCmd()
	root.SetArgs(args)
	root.SetOut(out)
	root.SetErr(errOut)
	err := root.ExecuteContext(ctx)
	a.close()
	return err
}

// Check parses one command line (without "fifobox") as the CLI would and,
// for an operation, returns the command it would run, validated as it is
// before anything is connected to; nothing runs. Errors name the flag. A
// command that is not an operation (dispatch, consume, provision, help)
// returns an empty command once its flags parse.
func Check(args []string) (redrive.Command, error) {
	a := &app{out: io.Discard, errOut: io.Discard, in: strings.NewReader("")}
	root := a.rootCmd()
	c, rest, err := root.Find(args)
	if err != nil {
		return redrive.Command{}, err
	}
	if err := c.ParseFlags(rest); errors.Is(err, pflag.ErrHelp) {
		return redrive.Command{}, nil
	} else if err != nil {
		return redrive.Command{}, fmt.Errorf("%s: %w", c.CommandPath(), err)
	}
	if c.Flags().NArg() > 0 {
		return redrive.Command{}, fmt.Errorf("%s: unexpected arguments %v", c.CommandPath(), c.Flags().Args())
	}
	path := strings.TrimPrefix(c.CommandPath(), root.Name()+" ")
	spec, ok := redrive.Spec(strings.ReplaceAll(path, " ", "-"))
	if !ok {
		if !c.Runnable() {
			return redrive.Command{}, fmt.Errorf("%s: not a command (its subcommands are)", c.CommandPath())
		}
		return redrive.Command{}, nil
	}
	cmd, err := commandFromFlags(c, spec)
	if err == nil {
		err = cmd.Validate()
	}
	if err != nil {
		return cmd, redrive.FlagError(err)
	}
	return cmd, nil
}

func isTerminal(f *os.File) bool {
	fi, err := f.Stat()
	return err == nil && fi.Mode()&os.ModeCharDevice != 0
}

func (a *app) close() {
	if a.tr != nil {
		_ = a.tr.Close()
	}
	if a.pool != nil {
		a.pool.Close()
	}
}

func (a *app) rootCmd() *cobra.Command {
	root := &cobra.Command{
		Use:   "fifobox",
		Short: "Operate a fifobox outbox pipeline (PostgreSQL outbox -> SNS FIFO, RabbitMQ or NATS -> consumers)",
		Long: `fifobox operates the outbox pipeline: schema migrations, status, dead events, retries,
dead-letter queues (list, peek, redrive, discard), replay to one consumer, pruning and
the audit trail; and runs the dispatcher and consumers as long-running processes.
Every change is audited in the redrive_audit table.

Locally it uses PostgreSQL (--database-url) and the transport FIFOBOX_TRANSPORT
names: SQS at AWS_ENDPOINT_URL (sns, the default), RabbitMQ (FIFOBOX_AMQP_URL,
FIFOBOX_AMQP_TOPOLOGY) or NATS JetStream (FIFOBOX_NATS_URL, FIFOBOX_NATS_TOPOLOGY).
Against AWS, --via-lambda FUNCTION runs the same command in the redrive Lambda:
each command is one operation of its JSON ({"operation": "dead-requeue", ...}).
A command that cannot do what it was asked says why on stderr and exits 1.`,
		SilenceUsage:  true,
		SilenceErrors: true,
		PersistentPreRun: func(*cobra.Command, []string) {
			// Library logs (the migrations') only with -v: the result is what
			// a command prints.
			slog.SetDefault(a.logger())
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
	pf.StringVar(&a.queuesJSON, "queues", os.Getenv(sns.EnvQueues), `with sns, consumer queues as JSON {"<consumer>":{"queue_url":"...","dlq_url":"...","subscription_dlq_url":"..."}} (env FIFOBOX_QUEUES; default: look up the topology's queue names)`)
	pf.BoolVar(&a.jsonOut, "json", false, "print the result as JSON (snake_case; durations in seconds)")
	pf.StringVar(&a.actor, "actor", who+"@"+host, "who is asking, recorded in the audit trail")
	pf.BoolVarP(&a.verbose, "verbose", "v", false, "log operation details to stderr")
	a.addOperations(root)
	root.AddCommand(a.provisionCmd(), a.captureCmd(), a.consumeCmd(), a.dispatchCmd())
	a.root = root
	return root
}

// run executes a command locally or through the redrive Lambda.
func (a *app) run(ctx context.Context, cmd redrive.Command) (redrive.Result, error) {
	cmd.Actor = a.actor
	// The same guards the function applies, checked before anything is
	// sent or connected to.
	if err := cmd.Validate(); err != nil {
		return redrive.Result{Operation: cmd.Operation}, err
	}
	if a.viaLambda != "" {
		return a.invoke(ctx, cmd)
	}
	svc, err := a.service(ctx, cmd.Operation)
	if err != nil {
		return redrive.Result{Operation: cmd.Operation}, err
	}
	return svc.Execute(ctx, cmd)
}

func (a *app) logger() *slog.Logger {
	if a.verbose {
		return slog.New(slog.NewTextHandler(a.errOut, nil))
	}
	return slog.New(slog.NewTextHandler(io.Discard, nil))
}

// databaseSource names where the connection string came from, for errors:
// the flag when it was given, else the variable.
func (a *app) databaseSource() string {
	if a.root != nil {
		if f := a.root.PersistentFlags().Lookup("database-url"); f != nil && f.Changed {
			return "--database-url"
		}
	}
	if os.Getenv("FIFOBOX_DATABASE_URL") != "" {
		return "FIFOBOX_DATABASE_URL"
	}
	return "--database-url (default " + DefaultDatabaseURL + ")"
}

func (a *app) connect(ctx context.Context) (*pgxpool.Pool, error) {
	if a.pool != nil {
		return a.pool, nil
	}
	cfg := db.Config{URL: a.databaseURL, MaxConns: 4, Schema: db.Env.Get("FIFOBOX_SCHEMA")}
	fromFlag := true
	if os.Getenv("FIFOBOX_DATABASE_URL") == "" && os.Getenv("FIFOBOX_DB_HOST") != "" && a.databaseURL == DefaultDatabaseURL {
		// RDS Proxy settings in the environment (a task or bastion set up
		// as the Lambdas are).
		c, err := db.FromEnv()
		if err != nil {
			return nil, err
		}
		cfg, fromFlag = c, false
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
		if fromFlag {
			// pkg/db names the variable; the value may have come from the flag.
			if src := a.databaseSource(); src != "FIFOBOX_DATABASE_URL" {
				err = errors.New(strings.Replace(err.Error(), "FIFOBOX_DATABASE_URL", src, 1))
			}
		}
		return nil, err
	}
	a.pool = pool
	return pool, nil
}

func (a *app) service(ctx context.Context, op string) (*redrive.Service, error) {
	spec, _ := redrive.Spec(op)
	cfg := redrive.Config{Logger: a.logger(), Progress: a.progress()}
	if op == redrive.OpDLQDiscard {
		// The discarded events are marked handled in the consumer's inbox
		// table: the same variable the consumer reads.
		t, err := inbox.TableFromEnv()
		if err != nil {
			return nil, err
		}
		cfg.Inbox = t
	}
	pool, err := a.connect(ctx)
	if err != nil {
		if op != redrive.OpStatus {
			return nil, err
		}
		// status shows what it can: the queues without the database.
		cfg.DBError = err
	}
	if spec.Broker {
		// The broker side goes through the transport, whichever it is.
		t, err := a.transport(ctx)
		if err == nil {
			cfg.Transport = string(t.Kind())
			cfg.Operations, err = t.Operations()
		}
		if err != nil {
			if op != redrive.OpStatus {
				return nil, err
			}
			cfg.Operations = brokenOps{err}
		}
	}
	return redrive.New(pool, cfg)
}

// brokenOps stands for a transport that could not be opened: status shows
// why in its queues section.
type brokenOps struct {
	err error
}

func (b brokenOps) Depths(context.Context, ...string) ([]transport.QueueDepth, error) {
	return nil, b.err
}
func (b brokenOps) Redrive(context.Context, transport.RedriveRequest) (transport.RedriveResult, error) {
	return transport.RedriveResult{}, b.err
}
func (b brokenOps) Replay(context.Context, string, []outbox.Message) (int, error) { return 0, b.err }
func (b brokenOps) Selects(string, outbox.Message) (bool, error)                  { return false, b.err }
func (b brokenOps) Peek(context.Context, transport.PeekRequest) (transport.PeekResult, error) {
	return transport.PeekResult{}, b.err
}
func (b brokenOps) Discard(context.Context, transport.DiscardRequest) (transport.DiscardResult, error) {
	return transport.DiscardResult{}, b.err
}

// transport opens the transport FIFOBOX_TRANSPORT names, once, with
// secrets from Secrets Manager as the Lambdas read them. --queues (sns) is
// its FIFOBOX_QUEUES.
func (a *app) transport(ctx context.Context) (transport.Transport, error) {
	if a.tr != nil {
		return a.tr, nil
	}
	if a.queuesJSON != os.Getenv(sns.EnvQueues) {
		if err := os.Setenv(sns.EnvQueues, a.queuesJSON); err != nil {
			return nil, err
		}
	}
	o := transport.Options{Logger: a.logger()}
	if needsSecrets() {
		awsCfg, err := a.aws(ctx)
		if err != nil {
			return nil, err
		}
		o.Secret = lambdafn.SecretsManager(awsCfg)
	}
	t, err := transport.Open(ctx, o)
	if err != nil {
		return nil, err
	}
	a.tr = t
	return t, nil
}

// needsSecrets reports whether a broker secret is configured (then the
// transport reads it from Secrets Manager, as the Lambdas do).
func needsSecrets() bool {
	return os.Getenv("FIFOBOX_AMQP_SECRET_ARN") != "" || os.Getenv("FIFOBOX_NATS_SECRET_ARN") != ""
}

// invoke sends cmd to the redrive Lambda and decodes its result.
func (a *app) invoke(ctx context.Context, cmd redrive.Command) (redrive.Result, error) {
	res := redrive.Result{Operation: cmd.Operation}
	awsCfg, err := a.aws(ctx)
	if err != nil {
		return res, err
	}
	client := lambdasvc.NewFromConfig(awsCfg, func(o *lambdasvc.Options) { o.HTTPClient = awsclient.HTTPClient() })
	payload, err := cmd.JSON()
	if err != nil {
		return res, err
	}
	fmt.Fprintf(a.errOut, "invoking %s: %s (runs synchronously; Lambda timeout applies)\n", a.viaLambda, cmd.Operation)
	out, err := client.Invoke(ctx, &lambdasvc.InvokeInput{FunctionName: aws.String(a.viaLambda), Payload: payload})
	if err != nil {
		return res, fmt.Errorf("invoke %s: %w", a.viaLambda, err)
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
		return res, fmt.Errorf("%s failed (%s): %s", a.viaLambda, aws.ToString(out.FunctionError), fe.ErrorMessage)
	}
	if err := json.Unmarshal(out.Payload, &res); err != nil {
		return res, fmt.Errorf("decode %s response: %w", a.viaLambda, err)
	}
	return res, nil
}

var errNoLocal = errors.New("this command needs a direct connection; it is not available with --via-lambda")
