// The screenshots of docs/mlflow_ui.md, taken in headless Chromium through playwright-core:
//   npm install playwright-core@1 && node docs/mlflow_ui_shots.js http://127.0.0.1:5000 EXPERIMENT_ID GRID_RUN_ID \
//       RUN_ID... [--chromium /usr/bin/chromium]
// against `mlflow ui` on a store holding a grid (`clozemath run configs/grids/smoke.yaml ...`): the runs table as the
// console's `browse:` link opens it, the compare view of RUN_ID..., and the grid run's report among its artifacts.
// Each page is shown as a newcomer finds it, except where noted: the MLflow Assistant's panel closed; on the compare
// page the visualizations and artifacts folded and "Show diff only" on for parameters and tags.
const { chromium } = require('playwright-core');

(async () => {
  const args = process.argv.slice(2);
  const at = args.indexOf('--chromium');
  const executablePath = at >= 0 ? args.splice(at, 2)[1] : '/usr/bin/chromium';
  const [ui, experiment, gridRun, ...runs] = args;
  const browser = await chromium.launch({ executablePath, args: ['--no-sandbox', '--disable-gpu'] });

  async function open(url, height) {
    const page = await browser.newPage({ viewport: { width: 1600, height } });
    await page.goto(url);
    await page.waitForTimeout(8000);  // the UI loads its runs and artifacts
    const assistant = page.getByRole('button', { name: 'Close', exact: true });
    if (await assistant.count()) await assistant.first().click();
    await page.waitForTimeout(1500);  // the table lays its columns out again in the width the panel left
    return page;
  }

  const view = `${ui}/#/experiments/${experiment}/runs?workflowType=machine_learning&viewStateShareKey=` +
    `clozemath-${process.env.GRID || 'smoke-grid'}`;
  let page = await open(view, 1000);
  await page.screenshot({ path: 'docs/mlflow_ui_runs.png' });

  const compare = `${ui}/#/compare-runs?runs=${encodeURIComponent(JSON.stringify(runs))}` +
    `&experiments=${encodeURIComponent(JSON.stringify([experiment]))}`;
  page = await open(compare, 1900);
  for (const section of ['Visualizations', 'Artifacts']) await page.getByText(section, { exact: true }).click();
  for (const section of ['Parameters', 'Tags']) {
    await page.getByRole('switch', { name: `${section} - Show diff only` })
      .or(page.getByRole('button', { name: `${section} - Show diff only` })).first().click();
  }
  await page.waitForTimeout(1500);
  await page.evaluate(() => document.querySelectorAll('main').forEach((main) => { main.scrollTop = 0; }));
  await page.screenshot({ path: 'docs/mlflow_ui_compare.png' });

  page = await open(`${ui}/#/experiments/${experiment}/runs/${gridRun}/artifacts/report/tables.md` +
    '?workflowType=machine_learning', 1000);
  await page.screenshot({ path: 'docs/mlflow_ui_report.png' });
  await browser.close();
})();
